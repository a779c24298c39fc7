"""One block's forward ops as nodes of the block ILP: result sizes, times, dependencies,
and which results the backward pass reads (JAX's own VJP residuals, probed by tracing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .blocks import abstract, block_io
from .graph.evaluate import eval_ops
from .graph.op_graph import Op, OpGraph
from .op_costs import is_heavy, op_cost


@dataclass(frozen=True)
class BlockGraph:
    """Forward ops of one block as ILP nodes (one node per op)."""

    sizes_bytes: tuple[int, ...]  # bytes of the node's result if it is kept
    live_bytes: tuple[int, ...]  # bytes it occupies when recomputed (0 if XLA fuses it away)
    times_s: tuple[float, ...]
    bwd_times_s: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]  # producer nodes inside the block
    residuals: frozenset[int]  # nodes whose result the backward pass reads
    keepable: frozenset[int]  # nodes with a floating result (can carry a checkpoint name)
    input_bytes: int
    output_bytes: int
    fwd_ws_bytes: int  # transient working memory of the forward (beyond kept values)
    bwd_ws_bytes: int  # transient working memory of the backward (beyond kept/recomputed)
    autodiff_extra_bytes: int = 0  # residuals plain autodiff saves that are not op results
    views: tuple[tuple[int, int], ...] = ()  # (view node, source node): kept only with its source


def block_graph(program: OpGraph, start: int, stop: int,
                profile: Mapping[str, float] | None = None) -> BlockGraph:
    """ILP nodes of ops [start, stop): sizes, times, dependencies and residual needs."""
    ops = program.ops[start:stop]
    local = {vid: j for j, op in enumerate(ops) for vid in op.outputs}
    ins, outs = block_io(program, start, stop)
    out_set = set(outs)
    consumers: dict[int, list[Op]] = {}
    for op in ops:
        for a in op.inputs:
            if a not in program.literals and a in local:
                consumers.setdefault(local[a], []).append(op)
    sizes, live, times, bwd, deps, keepable = [], [], [], [], [], set()
    residuals: set[int] = set()
    for j, op in enumerate(ops):
        cost = op_cost(program, op, profile)
        size = sum(program.vars[v].nbytes for v in op.outputs)
        materialized = (is_heavy(op) or any(is_heavy(c) for c in consumers.get(j, ()))
                        or any(v in out_set for v in op.outputs))
        sizes.append(size)
        live.append(size if materialized else 0)
        times.append(cost.time_s)
        bwd.append(cost.bwd_time_s)
        d = tuple(sorted({local[a] for a in op.inputs if a not in program.literals and a in local}))
        deps.append(d)
        if all(program.vars[v].is_float for v in op.outputs) and op.outputs:
            keepable.add(j)
        if cost.needs_output:
            residuals.add(j)
        if cost.needs_inputs:
            residuals.update(d)
    probed = autodiff_residuals(program, start, stop)
    extra = 0
    if probed is not None:
        residuals, extra = set(probed[0]), probed[1]
    # reshapes are bitcasts in XLA: keeping one costs nothing beyond its (kept) source
    views = {}
    for j, op in enumerate(ops):
        if op.name in _VIEWS and deps[j] and len(op.inputs) == 1:
            views[j] = deps[j][0]
            sizes[j] = 0
    # a residual XLA would otherwise fuse away still occupies memory when kept/recomputed,
    # except broadcasts and scalar converts, which XLA re-fuses into their consumers
    live = [sizes[j] if j in residuals and ops[j].name not in _FREE else live[j]
            for j in range(len(ops))]
    in_bytes = sum(program.vars[v].nbytes for v in ins if v not in program.literals)
    out_bytes = sum(program.vars[v].nbytes for v in outs)
    big = max(live, default=0)
    return BlockGraph(tuple(sizes), tuple(live), tuple(times), tuple(bwd), tuple(deps),
                      frozenset(residuals), frozenset(keepable), in_bytes, out_bytes,
                      fwd_ws_bytes=big, bwd_ws_bytes=2 * big, autodiff_extra_bytes=extra,
                      views=tuple(sorted(views.items())))


_VIEWS = {"reshape", "squeeze", "expand_dims"}
_FREE = {"broadcast_in_dim", "iota", "convert_element_type", "reshape", "squeeze", "expand_dims"}


def autodiff_residuals(program: OpGraph, start: int, stop: int) -> tuple[frozenset[int], int] | None:
    """Which ops' results JAX's own VJP of ops [start, stop) saves (local indices), and the
    bytes of saved values that are not op results (linearization intermediates)."""
    import jax

    ins, outs = block_io(program, start, stop)
    if not outs:
        return None
    captured: dict = {}

    def fn(*vals):
        env = dict(zip(ins, vals))
        eval_ops(program, env, range(start, stop))
        captured.clear()
        captured.update(env)
        return tuple(env[o] for o in outs)

    found: list = []

    def probe(*vals):
        out, vjp_fn = jax.vjp(fn, *vals)
        by_id = {id(getattr(v, "primal", v)): vid for vid, v in captured.items()}
        producer = {vid: j for j, op in enumerate(program.ops[start:stop]) for vid in op.outputs}
        res, extra = set(), 0
        for leaf in jax.tree.leaves(vjp_fn):
            vid = by_id.get(id(leaf))
            if vid is not None and vid in producer:
                res.add(producer[vid])
            elif vid is None:
                extra += int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize
        found.append((frozenset(res), extra))
        return out

    try:
        jax.make_jaxpr(probe)(*[abstract(program, v) for v in ins])
    except Exception:  # non-differentiable blocks (e.g. integer-only): fall back to rules
        return None
    return found[0]


