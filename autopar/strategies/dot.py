"""Alpa's sharding strategies for dot_general with arbitrary dimension numbers.

Each live mesh axis takes one role: split a batch dim (both operands and the result), a
free dim of the lhs (M) or rhs (N), or a contracting dim (K). A K split leaves partial
sums: either all-reduced over that axis (result replicated there) or reduce-scattered so
the result ends up split over that axis along one of its dims. Partial sums of different
contracting dims are combined one dim at a time, as XLA does. Two axes on one dim give S01.
"""
from __future__ import annotations

from typing import Any

from rockmate.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy
from autopar.strategies.layouts import replicated_strategy
from autopar.strategies.roles import Role, role_strategies


def dot_general_strategies(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
                           mesh: Any) -> list[Strategy]:
    lhs, rhs = ins
    out = outs[0]
    flops = _flops(op, lhs, out)
    if lhs is None or rhs is None:  # a literal operand: keep it simple
        return [replicated_strategy(mesh, ins, outs, flops)]
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    LHS, RHS, OUT = 0, 1, 2
    nb = len(lb)
    roles = [Role(((LHS, lb[i]), (RHS, rb[i]), (OUT, i))) for i in range(nb)]
    roles += [Role(((LHS, d), (OUT, nb + i))) for i, d in enumerate(lf)]
    roles += [Role(((RHS, d), (OUT, nb + len(lf) + i))) for i, d in enumerate(rf)]
    roles += [Role(((LHS, lc[i]), (RHS, rc[i])), partial=True) for i in range(len(lc))]
    return role_strategies(mesh, ins, outs, roles, flops, dtype=lhs.dtype)


def _flops(op: Op, lhs: TensorSpec | None, out: TensorSpec) -> float:
    if op.flops:
        return float(op.flops)
    (lc, _), _ = op.params["dimension_numbers"]
    k = 1
    if lhs is not None:
        for d in lc:
            k *= lhs.shape[d]
    return 2.0 * out.size * k
