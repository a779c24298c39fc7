"""Pipeline executor: per-stage jitted forward/backward programs on submeshes.

For each stage: `forward(params, batch, acts) -> (outs, vjp residuals)` via `jax.vjp`,
`backward(residuals, cotangents, grad_acc) -> (grad_acc + grads, input cotangents)`.
Tasks are issued from Python in schedule order; activations and cotangents move to the
next stage with `jax.device_put`; JAX's asynchronous dispatch overlaps the stages.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopar.pipeline.schedule import Task
from autopar.pipeline.split import StageSpec, is_float, stage_function


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of the mesh holds the whole value."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Leading dimension split over all mesh axes when it divides evenly, else replicated."""
    if len(shape) and shape[0] % mesh.devices.size == 0 and mesh.devices.size > 1:
        return NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return replicated(mesh)


class CompiledOnFirstCall:
    """A jitted function compiled ahead of time on its first call; keeps the Compiled.

    `make_fn(args)` builds the function from the first call's arguments (so it can pin
    accumulator outputs to their inputs' shardings)."""

    def __init__(self, make_fn: Callable[..., Callable[..., Any]], name: str,
                 compiler_options: dict | None = None):
        self.make_fn = make_fn
        self.name = name
        self.compiler_options = compiler_options
        self.compiled: Any = None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = jax.jit(self.make_fn(args)).lower(*args).compile(self.compiler_options)
        return self.compiled(*args)


def _pin(values: tuple, like: tuple) -> tuple:
    """Keep accumulators on their inputs' shardings, so the next call matches."""
    return tuple(jax.lax.with_sharding_constraint(v, a.sharding) for v, a in zip(values, like))


def jaxpr_key(closed_jaxpr: Any, eqn_range: tuple[int, int], invars: Sequence[Any],
              outvars: Sequence[Any]) -> str:
    """Text of a slice of a jaxpr (with its constants' digests): equal keys compute the
    same function, so their compiled programs can be shared."""
    jaxpr = closed_jaxpr.jaxpr
    with warnings.catch_warnings():   # a key only: no debug info needed
        warnings.simplefilter("ignore", DeprecationWarning)
        sub = jcore.Jaxpr(jaxpr.constvars, list(invars), list(outvars),
                          jaxpr.eqns[eqn_range[0]:eqn_range[1]])
    digests = tuple((np.shape(c), str(np.asarray(c).dtype), hash(np.asarray(c).tobytes()))
                    for c in closed_jaxpr.consts)
    return f"{sub}\n{digests}"


_PROGRAM_CACHE: dict[Any, "StageProgram"] = {}


@dataclass
class StageProgram:
    """The compiled programs of one stage and where they run."""

    spec: StageSpec
    mesh: Mesh
    forward: CompiledOnFirstCall
    backward: CompiledOnFirstCall
    float_in: tuple[bool, ...]   # per in_act: differentiable?
    float_out: tuple[bool, ...]  # per out_act: differentiable?


def stage_program(spec: StageSpec, closed_jaxpr: Any, mesh: Mesh,
                  compiler_options: dict | None = None, layout: Any = ()) -> StageProgram:
    """The stage's programs, shared with earlier pipelines that had the same stage (same
    equations, devices, parameter layout `layout` and compiler options)."""
    jaxpr = closed_jaxpr.jaxpr
    invars = [jaxpr.invars[i] for i in spec.param_leaves + spec.batch_leaves] + list(spec.in_acts)
    key = (jaxpr_key(closed_jaxpr, (spec.eqn_start, spec.eqn_end), invars, spec.out_acts),
           spec.index, tuple(d.id for d in mesh.devices.flat), mesh.devices.shape,
           tuple(sorted((compiler_options or {}).items())), layout)
    if key not in _PROGRAM_CACHE:
        _PROGRAM_CACHE[key] = _stage_programs(spec, closed_jaxpr, mesh, compiler_options)
    cached = _PROGRAM_CACHE[key]
    return StageProgram(spec, mesh, cached.forward, cached.backward, cached.float_in, cached.float_out)


def _stage_programs(spec: StageSpec, closed_jaxpr: Any, mesh: Mesh,
                    compiler_options: dict | None) -> StageProgram:
    fn = stage_function(closed_jaxpr, spec)
    float_in = tuple(is_float(v.aval) for v in spec.in_acts)
    float_out = tuple(is_float(v.aval) for v in spec.out_acts)

    def merge(fl, it, mask):
        fl, it = iter(fl), iter(it)
        return tuple(next(fl) if m else next(it) for m in mask)

    def forward(params, batch, acts_float, acts_int, loss_acc, loss_scale, pin=()):
        def f(p, af):
            outs = fn(p, batch, merge(af, acts_int, float_in))
            return (tuple(o for o, m in zip(outs, float_out) if m),
                    tuple(o for o, m in zip(outs, float_out) if not m))
        out_f, vjp_fn, out_i = jax.vjp(f, params, acts_float, has_aux=True)
        # the last stage sums the loss over micro-batches (loss_acc is () elsewhere)
        loss_acc = tuple(a + out_f[0] * loss_scale for a in loss_acc)
        return out_f, out_i, vjp_fn, _pin(loss_acc, pin)

    def backward(vjp_fn, cts, grad_acc, pin=()):
        ct = tuple(sum(c[1:], c[0]) for c in cts)
        g_params, g_acts = vjp_fn(ct)
        return _pin(tuple(a + g for a, g in zip(grad_acc, g_params)), pin), g_acts

    def make_forward(args):
        return lambda *a: forward(*a, pin=args[4])

    def make_backward(args):
        return lambda *a: backward(*a, pin=args[2])

    name = f"stage{spec.index}"
    return StageProgram(spec, mesh, CompiledOnFirstCall(make_forward, name + "_forward", compiler_options),
                        CompiledOnFirstCall(make_backward, name + "_backward", compiler_options),
                        float_in, float_out)


@dataclass
class PipelineRun:
    """What one pipelined gradient computation returns and what it observed."""

    loss: Any
    grads: dict[int, Any]                  # loss invar position -> gradient, on the owner stage
    peak_live_micro_batches: list[int]     # per stage: most residual sets alive at once
    order: list[Task] = field(default_factory=list)


class PipelineRuntime:
    """Runs forward/backward of a cut loss over micro-batches with a given task order."""

    def __init__(self, closed_jaxpr: Any, specs: Sequence[StageSpec], meshes: Sequence[Mesh],
                 order: Sequence[Task], num_micro_batches: int,
                 compiler_options: dict | None = None,
                 param_sharding_fn: Callable[[int, int, Any, Mesh], Any] | None = None):
        if len(specs) != len(meshes):
            raise ValueError(f"{len(specs)} stages but {len(meshes)} submeshes")
        self.closed_jaxpr = closed_jaxpr
        self.param_sharding_fn = param_sharding_fn
        self.specs = list(specs)
        self.meshes = list(meshes)
        self.programs = [stage_program(sp, closed_jaxpr, m, compiler_options,
                                       tuple(repr(self.param_sharding(sp.index, i)) for i in sp.param_leaves))
                         for sp, m in zip(specs, meshes)]
        self.order = list(order)
        self.num_micro_batches = num_micro_batches
        invars = closed_jaxpr.jaxpr.invars
        self.owner: dict[int, int] = {}     # param leaf -> first stage that reads it
        for sp in self.specs:
            for i in sp.param_leaves:
                self.owner.setdefault(i, sp.index)
        self.unused_params = [i for i, v in enumerate(invars) if i not in self.owner]
        producer = {v: sp.index for sp in self.specs for v in sp.out_acts}
        # consumers[s][k]: stages that read out_act k of stage s (for cotangent sums)
        self.consumers = [[[t.index for t in self.specs if v in t.in_acts] for v in sp.out_acts]
                          for sp in self.specs]
        self.producer = producer

    def param_sharding(self, stage: int, leaf: int) -> NamedSharding:
        """Where parameter `leaf` (loss invar position) lives on `stage`: the intra-op
        plan's choice when a `param_sharding_fn` is given, else replicated."""
        mesh = self.meshes[stage]
        if self.param_sharding_fn is None:
            return replicated(mesh)
        sh = self.param_sharding_fn(stage, leaf, self.closed_jaxpr.jaxpr.invars[leaf].aval, mesh)
        return sh if isinstance(sh, NamedSharding) else NamedSharding(mesh, sh)

    def run(self, leaves: Sequence[Any], diff_mask: Sequence[bool],
            split_mask: Sequence[bool] | None = None) -> PipelineRun:
        """Pipelined loss and gradients. `leaves` are the loss's flattened arguments at full
        batch size; non-differentiated leaves are split along axis 0 into micro-batches
        (only those marked in `split_mask` when given; the rest go whole to each)."""
        B = self.num_micro_batches
        jaxpr = self.closed_jaxpr.jaxpr
        if split_mask is None:
            split_mask = [not d and np.ndim(x) > 0 for x, d in zip(leaves, diff_mask)]
        micro = {}
        for i, (x, d) in enumerate(zip(leaves, diff_mask)):
            if d:
                continue
            if not split_mask[i]:
                micro[i] = [x] * B
                continue
            if np.shape(x)[0] % B:
                raise ValueError(f"batch argument leaf {i} of shape {np.shape(x)} has a leading "
                                 f"dimension not divisible by num_micro_batches={B}")
            micro[i] = split_micro_batches(x, B)
        stage_params = []
        for prog in self.programs:
            sp = prog.spec
            stage_params.append(tuple(jax.device_put(leaves[i], self.param_sharding(sp.index, i))
                                      for i in sp.param_leaves))
        grad_acc = []
        for prog, params in zip(self.programs, stage_params):
            grad_acc.append(tuple(jax.device_put(np.zeros(p.shape, p.dtype), p.sharding) for p in params))
        inbox: dict[tuple[int, int, Any], Any] = {}      # (stage, mb, var) -> activation there
        ct_inbox: dict[tuple[int, int, int], list] = {}  # (stage, mb, out_act k) -> cotangents
        residuals: dict[tuple[int, int], Any] = {}
        live = [0] * len(self.programs)
        peak = [0] * len(self.programs)
        last = len(self.programs) - 1
        loss_aval = self.specs[-1].out_acts[0].aval
        last_mesh = self.programs[-1].mesh
        loss_acc = (jax.device_put(np.zeros((), loss_aval.dtype), replicated(last_mesh)),)
        loss_scale_for = [jax.device_put(np.asarray(1.0 / B, loss_aval.dtype), replicated(p.mesh))
                          for p in self.programs]
        loss_scale = loss_scale_for[last]
        for task in self.order:
            s, m = task.stage, task.micro_batch
            prog = self.programs[s]
            sp = prog.spec
            if task.kind == "F":
                batch = tuple(jax.device_put(micro[i][m], batch_sharding(prog.mesh, micro[i][m].shape))
                              for i in sp.batch_leaves)
                acts = [inbox.pop((s, m, v)) for v in sp.in_acts]
                af = tuple(a for a, f in zip(acts, prog.float_in) if f)
                ai = tuple(a for a, f in zip(acts, prog.float_in) if not f)
                if s == last:
                    out_f, out_i, vjp_fn, loss_acc = prog.forward(
                        stage_params[s], batch, af, ai, loss_acc, loss_scale)
                else:
                    out_f, out_i, vjp_fn, _ = prog.forward(stage_params[s], batch, af, ai, (), loss_scale_for[s])
                residuals[(s, m)] = vjp_fn
                live[s] += 1
                peak[s] = max(peak[s], live[s])
                outs = _merge(out_f, out_i, prog.float_out)
                if s == last:
                    continue
                for k, (v, x) in enumerate(zip(sp.out_acts, outs)):
                    for t in self.consumers[s][k]:
                        dst = self.programs[t].mesh
                        inbox[(t, m, v)] = jax.device_put(x, batch_sharding(dst, x.shape))
            else:
                vjp_fn = residuals.pop((s, m))
                live[s] -= 1
                if s == last:
                    cts = ((loss_scale,),)
                else:
                    cts = tuple(tuple(ct_inbox.pop((s, m, k)))
                                for k, f in enumerate(prog.float_out) if f)
                grad_acc[s], g_acts = prog.backward(vjp_fn, cts, grad_acc[s])
                float_vars = [v for v, f in zip(sp.in_acts, prog.float_in) if f]
                for v, g in zip(float_vars, g_acts):
                    src = self.producer[v]
                    k = self.programs[src].spec.out_acts.index(v)
                    ct_inbox.setdefault((src, m, k), []).append(
                        jax.device_put(g, batch_sharding(self.programs[src].mesh, g.shape)))
        loss = loss_acc[0]
        grads: dict[int, Any] = {}
        for prog, acc in zip(self.programs, grad_acc):
            for i, g in zip(prog.spec.param_leaves, acc):
                owner_sharding = self.param_sharding(self.owner[i], i)
                g = jax.device_put(g, owner_sharding)
                grads[i] = g if i not in grads else grads[i] + g
        for i in self.unused_params:
            if diff_mask[i]:
                grads[i] = jnp.zeros_like(leaves[i])
        return PipelineRun(loss, grads, peak, list(self.order))


_split = jax.jit(lambda x, B: tuple(x.reshape(B, x.shape[0] // B, *x.shape[1:])),
                 static_argnums=1)


def split_micro_batches(x: Any, B: int) -> list[Any]:
    """B equal slices of x along axis 0 (one small program, on x's current devices)."""
    if B == 1:
        return [x]
    if isinstance(x, np.ndarray):
        return list(np.split(x, B))
    return list(_split(x, B))


def _merge(fl, it, mask):
    fl, it = iter(fl), iter(it)
    return tuple(next(fl) if m else next(it) for m in mask)
