"""Alpa's sharding strategies for dot_general with arbitrary dimension numbers.

Each live mesh axis takes one role: split a batch dim (both operands and the result), a
free dim of the lhs (M) or rhs (N), or a contracting dim (K). A K split leaves partial
sums: either all-reduced over that axis (result replicated there) or reduce-scattered so
the result ends up split over that axis along one of its dims. Partial sums of different
contracting dims are combined one dim at a time, as XLA does. Two axes on one dim give
S01.
"""
from __future__ import annotations

import itertools
from typing import Any

from autopar.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy, is_valid
from autopar.strategies.layouts import dedupe, live_axes, make_strategy, mesh_shape_of
from autopar.strategies.roles import partial_sum_collectives


def dot_general_strategies(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
                           mesh: Any) -> list[Strategy]:
    lhs, rhs = ins
    out = outs[0]
    ms = mesh_shape_of(mesh)
    if lhs is None or rhs is None:  # a literal operand: keep it simple
        from autopar.strategies.layouts import replicated_strategy
        return [replicated_strategy(mesh, ins, outs, _flops(op, lhs, rhs, out))]
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    nb = len(lb)
    # role -> (lhs dim, rhs dim, out dim); None where the role does not touch that tensor
    roles: list[tuple[str, int | None, int | None, int | None]] = []
    roles += [("b", lb[i], rb[i], i) for i in range(nb)]
    roles += [("m", d, None, nb + i) for i, d in enumerate(lf)]
    roles += [("n", None, d, nb + len(lf) + i) for i, d in enumerate(rf)]
    roles += [("k", lc[i], rc[i], None) for i in range(len(lc))]
    axes = live_axes(ms)
    flops = _flops(op, lhs, rhs, out)
    result: list[Strategy] = []
    for choice in itertools.product([None, *roles], repeat=len(axes)):
        ls = [() for _ in range(lhs.ndim)]
        rs = [() for _ in range(rhs.ndim)]
        os_ = [() for _ in range(out.ndim)]
        k_axes: list[int] = []
        k_role: dict[int, int] = {}
        for a, role in zip(axes, choice):
            if role is None:
                continue
            _, dl, dr, do = role
            if dl is not None:
                ls[dl] += (a,)
            if dr is not None:
                rs[dr] += (a,)
            if do is not None:
                os_[do] += (a,)
            else:
                k_axes.append(a)
                k_role[a] = dl
        lspec, rspec = tuple(ls), tuple(rs)
        if not (is_valid(lhs.shape, lspec, ms) and is_valid(rhs.shape, rspec, ms)):
            continue
        # each partial-sum axis: all-reduce (None) or reduce-scatter onto an out dim
        for targets in itertools.product([None, *range(out.ndim)], repeat=len(k_axes)):
            ospec = list(os_)
            for a, d in zip(k_axes, targets):
                if d is not None:
                    ospec[d] += (a,)
            ospec_t = tuple(ospec)
            if any(list(x) != sorted(x) for x in ospec_t) or not is_valid(out.shape, ospec_t, ms):
                continue
            groups: dict[int, tuple[list[int], list[int]]] = {}
            for a, d in zip(k_axes, targets):
                groups.setdefault(k_role[a], ([], []))[0 if d is not None else 1].append(a)
            colls = partial_sum_collectives([out], [ospec_t], list(groups.values()), ms)
            result.append(make_strategy(mesh, ins, outs, (lspec, rspec), (ospec_t,), flops, colls,
                                        dtype=lhs.dtype))
    return dedupe(result)


def _flops(op: Op, lhs: TensorSpec | None, rhs: TensorSpec | None, out: TensorSpec) -> float:
    if op.flops:
        return float(op.flops)
    (lc, _), _ = op.params["dimension_numbers"]
    k = 1
    if lhs is not None:
        for d in lc:
            k *= lhs.shape[d]
    return 2.0 * out.size * k
