"""The SPMD pipeline: a loss whose layers are one `lax.scan` (flax `nn.scan`, nnx scan)
run as a pipeline inside one `jit`.

The scan's stacked weights `[L, ...]` become `[S, L/S, ...]` sharded over the mesh's
first axis (the stage axis, `x`); the batch is split into M micro-batches, each split
again over the second axis (`y`, data parallel inside a stage). Inside a `shard_map`
every stage runs a `scan` over M + S - 1 ticks: at tick t, stage s applies its L/S
layers to micro-batch t - s and `ppermute`s the result to stage s + 1. Each tick is
`jax.checkpoint`ed, so the backward pass (JAX's transpose of the same scan, run in
reverse tick order) keeps only the activations entering each tick and recomputes the
rest. The loss's other equations (embedding, head, loss) run where they are, under GSPMD.
No Python driver issues per-stage programs, so the same program runs on every host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe
from jax.sharding import Mesh, PartitionSpec as P

from autopar.sharding_spec import AXIS_NAMES

STAGE_AXIS, DATA_AXIS = AXIS_NAMES


class SpmdPipelineError(ValueError):
    """The loss cannot run as an SPMD pipeline (the message says why and what to do)."""


@dataclass(frozen=True)
class LayerScan:
    """The scan over layers in a loss jaxpr: its position, trip count L, and how its
    inputs split (stacked weights over stages, batch-major values over micro-batches)."""

    eqn_index: int
    length: int                         # L: layers in the stack
    num_consts: int
    num_carry: int
    batch_size: int                     # the carries' leading dimension
    batch_consts: tuple[bool, ...]      # per scan constant: split along the batch like the carry
    stacked_shapes: tuple[tuple[int, ...], ...]  # the stacked weights, [L, ...] each
    stacked_bytes: int


def _dependents(jaxpr: Any, sources: Sequence[Any]) -> set:
    """The vars of `jaxpr` computed (transitively) from `sources`."""
    seen = set(sources)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jax_core.Literal) and v in seen for v in eqn.invars):
            seen.update(eqn.outvars)
    return seen


def find_layer_scan(jaxpr: Any, num_batch_inputs: int) -> LayerScan:
    """The scan over layers of an open loss jaxpr whose first `num_batch_inputs` inputs are
    the values the loss closes over (the batch) and the rest its differentiated arguments:
    the top-level scan with the most bytes of stacked inputs. Raises SpmdPipelineError when
    there is none or it cannot be pipelined."""
    scans = [(i, e) for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"]
    if not scans:
        raise SpmdPipelineError(
            "the SPMD pipeline needs the model's layers as one lax.scan over stacked weights (flax nn.scan, "
            "nnx.scan, or lax.scan over a stacked params tree) at the top level of the loss; this loss has no "
            "scan. Use PipeshardParallel's per-stage runtime for unrolled layers.")

    def stacked(e):
        n = e.params["num_consts"] + e.params["num_carry"]
        return sum(v.aval.size * v.aval.dtype.itemsize for v in e.invars[n:])

    index, eqn = max(scans, key=lambda ie: stacked(ie[1]))
    p = eqn.params
    nc, ncar, L = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = eqn.invars[:nc], eqn.invars[nc:nc + ncar], eqn.invars[nc + ncar:]
    if p["reverse"]:
        raise SpmdPipelineError("the layer scan runs in reverse; the SPMD pipeline runs layers first to last")
    if not xs:
        raise SpmdPipelineError("the layer scan has no stacked inputs (no per-layer weights to split over stages)")
    if not carry or any(not v.aval.shape for v in carry):
        raise SpmdPipelineError("the layer scan's carry must be batch-major activations (e.g. x [batch, seq, "
                                "hidden]); it has none or a scalar")
    sizes = {v.aval.shape[0] for v in carry}
    if len(sizes) != 1:
        raise SpmdPipelineError(f"the layer scan's carries disagree on the batch dimension: leading dims {sorted(sizes)}")
    N = sizes.pop()
    batch_vars = _dependents(jaxpr, jaxpr.invars[:num_batch_inputs])
    if any(not isinstance(v, jax_core.Literal) and v in batch_vars for v in xs):
        raise SpmdPipelineError("a per-layer input of the layer scan depends on the batch; only weights (values "
                                "that do not depend on the batch) can be stacked over pipeline stages")
    later = set()
    for e in jaxpr.eqns[index + 1:]:
        later.update(v for v in e.invars if not isinstance(v, jax_core.Literal))
    later.update(v for v in jaxpr.outvars if not isinstance(v, jax_core.Literal))
    if any(v in later for v in eqn.outvars[ncar:]):
        raise SpmdPipelineError("the layer scan's per-layer outputs are used after the scan; the SPMD pipeline "
                                "passes only the carry from stage to stage. Return None as the scan's output.")
    batch_consts = []
    for v in consts:
        is_batch = not isinstance(v, jax_core.Literal) and v in batch_vars
        if is_batch and (not v.aval.shape or v.aval.shape[0] != N):
            raise SpmdPipelineError(f"the layer scan reads a batch-derived value of shape {v.aval.shape} whose "
                                    f"leading dimension is not the batch ({N}); it cannot be split into micro-batches")
        batch_consts.append(is_batch)
    return LayerScan(eqn_index=index, length=L, num_consts=nc, num_carry=ncar, batch_size=N,
                     batch_consts=tuple(batch_consts), stacked_shapes=tuple(tuple(v.aval.shape) for v in xs),
                     stacked_bytes=stacked(eqn))


def local_body(loss_jaxpr: Any, num_batch_inputs: int, full: LayerScan) -> Any:
    """The layer scan's body (a ClosedJaxpr) from the loss traced on the rows one device
    holds of one micro-batch; it must be the same scan as `full`'s, at a smaller batch."""
    scan = find_layer_scan(loss_jaxpr, num_batch_inputs)
    if (scan.num_consts, scan.num_carry, scan.length, scan.stacked_shapes, scan.batch_consts) != (
            full.num_consts, full.num_carry, full.length, full.stacked_shapes, full.batch_consts):
        raise SpmdPipelineError("the layer scan differs between the full batch and one micro-batch (other "
                                "inputs, layers or weights); the SPMD pipeline needs the same stack at every batch size")
    return loss_jaxpr.eqns[scan.eqn_index].params["jaxpr"]


def check_divisible(scan: LayerScan, num_stages: int, num_micro_batches: int, data: int) -> None:
    """Clear errors for a stack, batch or mesh the pipeline cannot split evenly."""
    if scan.length % num_stages:
        raise SpmdPipelineError(f"{scan.length} layers do not split into {num_stages} equal stages; "
                                f"choose num_stages among the divisors of {scan.length}")
    if scan.batch_size % num_micro_batches:
        raise SpmdPipelineError(f"the batch of {scan.batch_size} does not split into {num_micro_batches} "
                                f"micro-batches; choose num_micro_batches among the divisors of {scan.batch_size}")
    mb = scan.batch_size // num_micro_batches
    if mb % data:
        raise SpmdPipelineError(f"micro-batches of {mb} rows do not split over {data} data-parallel devices per "
                                f"stage; use fewer micro-batches or more stages")


def pipelined_loss(fun: Callable[..., Any], args: tuple, mesh: Mesh, num_micro_batches: int,
                   body: Any) -> Callable[..., Any]:
    """`fun` (a scalar loss of `args`, which may close over the batch) with its layer scan
    run as the SPMD pipeline over `mesh` (stages along its first axis). `body` is the scan's
    body traced at the rows one device holds of one micro-batch (`local_body`)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    closed = jax.make_jaxpr(lambda *l: fun(*jax.tree_util.tree_unflatten(tree, l)))(*leaves)
    jaxpr, consts = closed.jaxpr, closed.consts
    scan = find_layer_scan(pe.convert_constvars_jaxpr(jaxpr), len(jaxpr.constvars))
    S, D = mesh.devices.shape
    check_divisible(scan, S, num_micro_batches, D)

    def run(*new_args):
        env: dict = {}
        read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, jax.tree_util.tree_leaves(new_args)):
            env[v] = x
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            if i == scan.eqn_index:
                outs = _pipelined_scan(eqn, invals, scan, mesh, num_micro_batches, body)
            else:
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return read(jaxpr.outvars[0])

    return run


def _pipelined_scan(eqn: Any, invals: list, scan: LayerScan, mesh: Mesh, M: int, body: Any) -> list:
    """The layer scan's outputs (the final carry; per-layer outputs are unused and zero)."""
    nc, ncar = scan.num_consts, scan.num_carry
    consts, carry, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]
    S, D = mesh.devices.shape
    L, N = scan.length, scan.batch_size
    mb = N // M
    weights = [x.reshape(S, L // S, *x.shape[1:]) for x in xs]
    split = lambda x: x.reshape(M, mb, *x.shape[1:])
    bconsts = [split(c) for c, b in zip(consts, scan.batch_consts) if b]
    gconsts = [c for c, b in zip(consts, scan.batch_consts) if not b]
    carries = [split(c) for c in carry]
    T = M + S - 1
    data = DATA_AXIS if D > 1 else None

    def layers(w_stage, consts_mb, x):
        """This stage's L/S layers on one micro-batch."""
        def layer(c, w_l):
            outs = jax_core.eval_jaxpr(body.jaxpr, body.consts, *consts_mb, *c, *w_l)
            return list(outs[:ncar]), None
        out, _ = lax.scan(layer, list(x), list(w_stage))
        return out

    def local(w, bc, gc, xs_mb):
        s = lax.axis_index(STAGE_AXIS)
        w = [a[0] for a in w]

        @jax.checkpoint
        def tick(state, t):
            first = [jnp.where(s == 0, x[jnp.clip(t, 0, M - 1)], st) for x, st in zip(xs_mb, state)]
            m = jnp.clip(t - s, 0, M - 1)
            it_b = iter([b[m] for b in bc])
            it_g = iter(gc)
            consts_mb = [next(it_b) if b else next(it_g) for b in scan.batch_consts]
            out = layers(w, consts_mb, first)
            sent = [lax.ppermute(o, STAGE_AXIS, [(i, i + 1) for i in range(S - 1)]) for o in out]
            return sent, out

        init = [jnp.zeros_like(x[0]) for x in xs_mb]
        _, ys = lax.scan(tick, init, jnp.arange(T))
        last = s == S - 1
        return [lax.psum(jnp.where(last, y[S - 1:], jnp.zeros_like(y[S - 1:])), STAGE_AXIS) for y in ys]

    batch_spec = P(None, data)
    # check_vma=False: the layer body is evaluated from its jaxpr, which bypasses the
    # automatic varying-axis casts shard_map's checker needs (inputs unmapped over y still
    # get their cotangents summed over y by shard_map's transpose; the tests compare grads)
    f = jax.shard_map(local, mesh=mesh,
                      in_specs=([P(STAGE_AXIS)] * len(weights), [batch_spec] * len(bconsts), [P()] * len(gconsts),
                                [batch_spec] * len(carries)),
                      out_specs=[batch_spec] * ncar, check_vma=False)
    outs = f(weights, bconsts, gconsts, carries)
    final = [o.reshape(N, *o.shape[2:]) for o in outs]
    ys = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[ncar:]]
    return final + ys
