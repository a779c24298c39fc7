"""Reductions, scans along an axis, sorts and windowed reductions (pooling).

Splitting a reduced dim of reduce_sum/max/min/prod/and/or/xor leaves one partial result
per device, combined by an all-reduce over those mesh axes (result replicated there) or a
reduce-scatter onto a kept dim (result split there).
argmax/argmin reduce (value, index) pairs, which no single all-reduce combines, so their
reduced dims stay whole (XLA would all-gather them anyway; the ILP sees that cost as
resharding on the input edge). Cumulative ops, sort and top_k keep the scanned/sorted dim
whole; pooling keeps every windowed dim whole.
"""
from __future__ import annotations

from typing import Any

from rockmate.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy
from autopar.strategies.layouts import (candidate_specs, follow_strategies, make_strategy,
                                        mesh_shape_of)
from autopar.strategies.roles import Role, role_strategies

Ins = tuple[TensorSpec | None, ...]
Outs = tuple[TensorSpec, ...]

REDUCE_PRIMITIVES = frozenset(
    ["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"])
ARG_REDUCE_PRIMITIVES = frozenset(["argmax", "argmin"])
CUMULATIVE_PRIMITIVES = frozenset(["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"])
WINDOW_PRIMITIVES = frozenset(["reduce_window_sum", "reduce_window_max", "reduce_window_min",
                               "reduce_window", "select_and_scatter_add", "select_and_gather_add",
                               "select_and_scatter"])


def _flops(op: Op, ins: Ins) -> float:
    if op.flops:
        return float(op.flops)
    return float(sum(t.size for t in ins if t is not None))


def reduce_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Kept dims split freely; a split reduced dim leaves partial results, all-reduced over
    its axes or reduce-scattered onto a kept dim (e.g. ZeRO-style sharded bias gradients)."""
    operand, out = ins[0], outs[0]
    reduced = {d % operand.ndim for d in op.params["axes"]}
    kept = [d for d in range(operand.ndim) if d not in reduced]
    n_in = len(ins)
    roles = [Role(((0, d), (n_in, kept.index(d))) if d in kept else ((0, d),), partial=d in reduced)
             for d in range(operand.ndim)]
    return role_strategies(mesh, ins, outs, roles, _flops(op, ins), dtype=operand.dtype)


def arg_reduce_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    ms = mesh_shape_of(mesh)
    operand = ins[0]
    axes_param = {d % operand.ndim for d in op.params["axes"]}
    mask = tuple(d not in axes_param for d in range(operand.ndim))
    result = []
    for spec in candidate_specs(operand.shape, ms, mask):
        out_spec = tuple(s for d, s in enumerate(spec) if d not in axes_param)
        result.append(make_strategy(mesh, ins, outs, [spec], [out_spec], _flops(op, ins),
                                    dtype=operand.dtype))
    return result


def cumulative_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand = ins[0]
    axis = op.params["axis"] % operand.ndim
    mask = tuple(d != axis for d in range(operand.ndim))
    return follow_strategies(mesh, ins, outs, operand, mask, _flops(op, ins))


def sort_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand = ins[0]
    dim = op.params["dimension"] % operand.ndim
    mask = tuple(d != dim for d in range(operand.ndim))
    return follow_strategies(mesh, ins, outs, operand, mask, _flops(op, ins))


def top_k_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand = ins[0]
    mask = tuple(d != operand.ndim - 1 for d in range(operand.ndim))
    return follow_strategies(mesh, ins, outs, operand, mask, _flops(op, ins))


def window_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Pooling and its gradients: dims with a size-1, stride-1, unpadded, undilated window
    (batch, channels) may be split; all operands and results share that layout."""
    p = op.params
    ref = outs[0]
    n = ref.ndim
    win = tuple(p.get("window_dimensions", (1,) * n))
    strides = tuple(p.get("window_strides", (1,) * n))
    padding = tuple(tuple(x) for x in p.get("padding", ((0, 0),) * n))
    base = tuple(p.get("base_dilation", (1,) * n) or (1,) * n)
    wdil = tuple(p.get("window_dilation", (1,) * n) or (1,) * n)
    mask = tuple(win[d] == 1 and strides[d] == 1 and padding[d] == (0, 0) and base[d] == 1
                 and wdil[d] == 1 for d in range(n))
    return follow_strategies(mesh, ins, outs, ref, mask, _flops(op, ins))
