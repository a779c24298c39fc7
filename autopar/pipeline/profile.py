"""Stage costs measured on the real devices (`PipeshardParallel(profile=True)`).

Each candidate (equation range, submesh, logical mesh) is compiled as the runtime would
run it (forward with `jax.vjp`, backward with gradient accumulation), timed, and its
memory read from `compiled.memory_analysis()`. Measurements are cached in the tuning
database (profile kind "stage") so re-planning the same model costs nothing.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from typing import Any, Sequence

import jax
import numpy as np

from autopar.pipeline.runtime import batch_sharding, jaxpr_key, replicated, stage_program
from autopar.pipeline.split import split_loss
from autopar.pipeline.stage_cost import StageCost

PROFILE_KIND = "stage"


def _example(aval: Any) -> Any:
    """A harmless input value: small floats, zero indices, PRNG keys from seed 0."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        n = int(np.prod(aval.shape, dtype=np.int64))
        return jax.random.split(jax.random.key(0), max(n, 1))[:n].reshape(aval.shape)
    if np.issubdtype(np.dtype(aval.dtype), np.floating):
        return np.full(aval.shape, 0.01, aval.dtype)
    return np.zeros(aval.shape, aval.dtype)


def _memory(compiled: Any) -> tuple[float, float]:
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes), float(m.output_size_in_bytes + m.temp_size_in_bytes)


class StageProfiler:
    """`(equation range, submesh, logical mesh) -> StageCost` by measurement, cached."""

    def __init__(self, loss_jaxpr: Any, diff_mask: Sequence[bool], devices: Sequence[Any],
                 state_bytes_per_param_byte: float = 4.0, db: Any = None,
                 compiler_options: dict | None = None, repeats: int = 3):
        self.loss_jaxpr, self.diff_mask, self.devices = loss_jaxpr, list(diff_mask), list(devices)
        self.state_factor = state_bytes_per_param_byte
        self.db, self.compiler_options, self.repeats = db, compiler_options, repeats
        self.measured = 0                      # measurements taken (not from the cache)

    def key(self, eqn_range: tuple[int, int], submesh: tuple[int, int],
            logical_mesh: tuple[int, int]) -> str:
        jaxpr = self.loss_jaxpr.jaxpr
        text = jaxpr_key(self.loss_jaxpr, eqn_range, jaxpr.invars, [])
        digest = hashlib.sha256(text.encode()).hexdigest()[:24]
        kind = self.devices[0].device_kind
        return f"{digest}/{kind}/{submesh[0]}x{submesh[1]}/{logical_mesh[0]}x{logical_mesh[1]}"

    def __call__(self, eqn_range: tuple[int, int], submesh: tuple[int, int],
                 logical_mesh: tuple[int, int]) -> StageCost:
        key = self.key(eqn_range, submesh, logical_mesh)
        if self.db is not None:
            hit = self.db.get_profile(PROFILE_KIND, key)
            if hit is not None:
                return StageCost(**hit)
        cost = self.measure(eqn_range, submesh, logical_mesh)
        if self.db is not None:
            self.db.put_profile(PROFILE_KIND, key, {
                "micro_batch_s": cost.micro_batch_s, "iteration_s": cost.iteration_s,
                "weight_bytes": cost.weight_bytes, "activation_bytes": cost.activation_bytes})
        return cost

    def measure(self, eqn_range: tuple[int, int], submesh: tuple[int, int],
                logical_mesh: tuple[int, int]) -> StageCost:
        """Compile and time forward + backward of one micro-batch through the range."""
        from autopar.pipeline.api import _make_mesh

        n = submesh[0] * submesh[1]
        if n > len(self.devices):
            raise ValueError(f"cannot profile submesh {submesh}: only {len(self.devices)} devices")
        a, b = eqn_range
        total = len(self.loss_jaxpr.jaxpr.eqns)
        cuts = sorted({0, a, b, total})
        specs = split_loss(self.loss_jaxpr.jaxpr, cuts, self.diff_mask)
        spec = next(sp for sp in specs if sp.eqn_start == a)
        mesh = _make_mesh(self.devices[:n], logical_mesh)
        prog = stage_program(spec, self.loss_jaxpr, mesh, self.compiler_options)
        invars = self.loss_jaxpr.jaxpr.invars
        params = tuple(jax.device_put(_example(invars[i].aval), replicated(mesh)) for i in spec.param_leaves)
        batch = tuple(jax.device_put(_example(invars[i].aval), batch_sharding(mesh, invars[i].aval.shape))
                      for i in spec.batch_leaves)
        acts = [jax.device_put(_example(v.aval), batch_sharding(mesh, v.aval.shape)) for v in spec.in_acts]
        af = tuple(x for x, f in zip(acts, prog.float_in) if f)
        ai = tuple(x for x, f in zip(acts, prog.float_in) if not f)
        scale = jax.device_put(np.float32(1.0), replicated(mesh))
        acc = tuple(jax.device_put(np.zeros(p.shape, p.dtype), p.sharding) for p in params)

        out_f, _, vjp_fn, _ = prog.forward(params, batch, af, ai, (), scale)   # compiles
        cts = tuple((jax.device_put(np.ones(o.shape, o.dtype), o.sharding),) for o in out_f)

        def once():
            _, _, vjp_fn, _ = prog.forward(params, batch, af, ai, (), scale)
            return prog.backward(vjp_fn, cts, acc)

        jax.block_until_ready(once())             # compiles the backward, warms up
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(once())
            times.append(time.perf_counter() - t0)
        self.measured += 1
        param_bytes = sum(p.nbytes for p in params)          # replicated: whole on each device
        _, fwd_out_bytes = _memory(prog.forward.compiled)
        return StageCost(micro_batch_s=statistics.median(times), iteration_s=0.0,
                         weight_bytes=param_bytes * self.state_factor,
                         activation_bytes=fwd_out_bytes)
