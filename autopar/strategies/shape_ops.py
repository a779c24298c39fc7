"""Layout rules for ops that move data without arithmetic: broadcast, reshape, transpose,
squeeze, concatenate, split, slices, pad, rev and iota. Splitting a dim is allowed where
every device's piece of the result comes from its own piece of the operand."""
from __future__ import annotations

from typing import Any

from rockmate.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy, is_valid
from autopar.strategies.layouts import (candidate_specs, follow_strategies,
                                        make_strategy, mesh_shape_of, replicated_strategy)

Ins = tuple[TensorSpec | None, ...]
Outs = tuple[TensorSpec, ...]


def _copy_flops(op: Op, outs: Outs) -> float:
    return float(op.flops) if op.flops else 0.0


def broadcast_in_dim_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Any result layout (new dims are split for free: each device makes its slice); operand
    dims follow their result dim through broadcast_dimensions, size-1 dims stay whole."""
    ms = mesh_shape_of(mesh)
    operand, out = ins[0], outs[0]
    bd = tuple(op.params["broadcast_dimensions"])
    result = []
    for spec in candidate_specs(out.shape, ms):
        if operand is None:
            in_spec = None
        else:
            in_spec = tuple(spec[bd[i]] if operand.shape[i] == out.shape[bd[i]] else ()
                            for i in range(operand.ndim))
        in_specs = [in_spec, *[None if t is None else tuple(() for _ in t.shape) for t in ins[1:]]]
        result.append(make_strategy(mesh, ins, outs, in_specs, [spec], _copy_flops(op, outs)))
    return result


def reshape_groups(in_shape: tuple[int, ...], out_shape: tuple[int, ...]
                   ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pair up minimal runs of operand dims and result dims with equal products (size-1
    dims left out). A run's first dim is its major dim."""
    ins = [d for d, n in enumerate(in_shape) if n != 1]
    outs = [d for d, n in enumerate(out_shape) if n != 1]
    groups = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, go = [ins[i]], [outs[j]]
        pi, po = in_shape[ins[i]], out_shape[outs[j]]
        i += 1
        j += 1
        while pi != po:
            if pi < po and i < len(ins):
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            elif po < pi and j < len(outs):
                go.append(outs[j])
                po *= out_shape[outs[j]]
                j += 1
            else:
                return []
        groups.append((tuple(gi), tuple(go)))
    return groups


def reshape_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """A split survives a reshape only on a merge/split group's major dim, and only if that
    dim is divisible on both sides: then every device's block is contiguous in both shapes."""
    ms = mesh_shape_of(mesh)
    operand, out = ins[0], outs[0]
    if operand is None or op.params.get("dimensions") is not None:
        return [replicated_strategy(mesh, ins, outs, 0.0)]
    major = {go[0]: gi[0] for gi, go in reshape_groups(operand.shape, out.shape)}
    mask = tuple(d in major for d in range(out.ndim))
    result = []
    for spec in candidate_specs(out.shape, ms, mask):
        in_spec: list[tuple[int, ...]] = [() for _ in operand.shape]
        for d, axes in enumerate(spec):
            if axes:
                in_spec[major[d]] = axes
        in_t = tuple(in_spec)
        if not is_valid(operand.shape, in_t, ms):
            continue
        in_specs = [in_t, *[None if t is None else tuple(() for _ in t.shape) for t in ins[1:]]]
        result.append(make_strategy(mesh, ins, outs, in_specs, [spec], _copy_flops(op, outs)))
    return result


def transpose_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    ms = mesh_shape_of(mesh)
    operand = ins[0]
    perm = tuple(op.params["permutation"])
    result = []
    for spec in candidate_specs(operand.shape, ms):
        out_spec = tuple(spec[p] for p in perm)
        result.append(make_strategy(mesh, ins, outs, [spec], [out_spec], _copy_flops(op, outs)))
    return result


def squeeze_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    ms = mesh_shape_of(mesh)
    operand = ins[0]
    dims = {d % operand.ndim for d in op.params["dimensions"]}
    result = []
    for spec in candidate_specs(operand.shape, ms):
        if any(spec[d] for d in dims):
            continue
        out_spec = tuple(s for d, s in enumerate(spec) if d not in dims)
        result.append(make_strategy(mesh, ins, outs, [spec], [out_spec], _copy_flops(op, outs)))
    return result


def expand_dims_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Inserted size-1 dims stay whole; the rest follow the operand (as a reshape)."""
    return reshape_strategies(op, ins, outs, mesh)


def _mask_except(ndim: int, dims) -> tuple[bool, ...]:
    dims = {d % ndim for d in dims} if ndim else set()
    return tuple(d not in dims for d in range(ndim))


def concatenate_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    out = outs[0]
    return follow_strategies(mesh, ins, outs, out, _mask_except(out.ndim, [op.params["dimension"]]),
                             _copy_flops(op, outs))


def split_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand = ins[0]
    return follow_strategies(mesh, ins, outs, operand, _mask_except(operand.ndim, [op.params["axis"]]),
                             _copy_flops(op, outs))


def _equal_dims_mask(a: TensorSpec, b: TensorSpec) -> tuple[bool, ...]:
    return tuple(x == y for x, y in zip(a.shape, b.shape))


def slice_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Only dims the slice keeps whole (and unstrided) may be split."""
    operand, out = ins[0], outs[0]
    strides = op.params.get("strides") or (1,) * operand.ndim
    mask = tuple(m and s == 1 for m, s in zip(_equal_dims_mask(operand, out), strides))
    return follow_strategies(mesh, ins, outs, operand, mask, _copy_flops(op, outs))


def dynamic_slice_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Index operands stay whole; dims sliced to their full size may be split."""
    operand, out = ins[0], outs[0]
    return follow_strategies(mesh, ins, outs, operand, _equal_dims_mask(operand, out),
                             _copy_flops(op, outs))


def dynamic_update_slice_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand, update = ins[0], ins[1]
    if update is None:
        mask = tuple(False for _ in operand.shape)
    else:
        mask = _equal_dims_mask(operand, update)
    return follow_strategies(mesh, ins, outs, operand, mask, _copy_flops(op, outs))


def pad_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand = ins[0]
    mask = tuple(tuple(cfg) == (0, 0, 0) for cfg in op.params["padding_config"])
    return follow_strategies(mesh, ins, outs, operand, mask, _copy_flops(op, outs))


def rev_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    operand = ins[0]
    return follow_strategies(mesh, ins, outs, operand, _mask_except(operand.ndim, op.params["dimensions"]),
                             _copy_flops(op, outs))


def iota_strategies(op: Op, ins: Ins, outs: Outs, mesh: Any) -> list[Strategy]:
    """Each device generates its own slice of the result: any layout, no communication."""
    ms = mesh_shape_of(mesh)
    out = outs[0]
    return [make_strategy(mesh, ins, outs, [], [spec], float(out.size)) for spec in candidate_specs(out.shape, ms)]

