"""Gather and scatter as produced by embedding lookups `table[ids]`, take_along_axis and
their gradients.

gather: split index batch dims (result follows, batching dims of the operand too), split
operand dims that are sliced whole (result offset dim follows), or split the indexed
operand dim (vocab-parallel: each device gathers the rows it owns, zeros elsewhere, then
an all-reduce or reduce-scatter combines the result).
scatter: split update window dims with the operand; split index batch dims (for
scatter-add: partial sums, all-reduced or reduce-scattered; for batching dims: local);
split the scattered operand dim (each device applies the updates landing in its rows).
"""
from __future__ import annotations

from typing import Any

from rockmate.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy
from autopar.strategies.roles import Role, role_strategies

SCATTER_PRIMITIVES = frozenset(["scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul",
                                "scatter-min", "scatter_min", "scatter-max", "scatter_max"])
_PARTIAL_OK = {"scatter-add": True, "scatter_add": True, "scatter-min": False, "scatter_min": False,
               "scatter-max": False, "scatter_max": False}


def gather_strategies(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
                      mesh: Any) -> list[Strategy]:
    operand, indices = ins[0], ins[1]
    out = outs[0]
    dn = op.params["dimension_numbers"]
    slice_sizes = tuple(op.params["slice_sizes"])
    OP, IDX, OUT = 0, 1, len(ins)
    roles: list[Role] = []
    idx_batch = [d for d in range(indices.ndim - 1)] if indices is not None else []
    out_batch = [d for d in range(out.ndim) if d not in dn.offset_dims]
    for ib, ob in zip(idx_batch, out_batch):
        dims = [(IDX, ib), (OUT, ob)]
        if ib in dn.start_indices_batching_dims:
            dims.append((OP, dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(ib)]))
        roles.append(Role(tuple(dims)))
    offset_operand = [d for d in range(operand.ndim)
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for od, oo in zip(offset_operand, dn.offset_dims):
        if slice_sizes[od] == operand.shape[od] and od not in dn.start_index_map:
            roles.append(Role(((OP, od), (OUT, oo))))
    for od in dn.start_index_map:
        if od in dn.collapsed_slice_dims and slice_sizes[od] == 1:
            roles.append(Role(((OP, od),), partial=True))
    flops = float(op.flops) if op.flops else float(out.size)
    return role_strategies(mesh, ins, outs, roles, flops, dtype=out.dtype)


def scatter_strategies(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
                       mesh: Any) -> list[Strategy]:
    operand, indices, updates = ins[0], ins[1], ins[2]
    out = outs[0]
    dn = op.params["dimension_numbers"]
    OP, IDX, UPD, OUT = 0, 1, 2, len(ins)
    roles: list[Role] = []
    window_operand = [d for d in range(operand.ndim)
                      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for od, uw in zip(window_operand, dn.update_window_dims):
        if updates.shape[uw] == operand.shape[od] and od not in dn.scatter_dims_to_operand_dims:
            roles.append(Role(((OP, od), (UPD, uw), (OUT, od))))
    upd_scatter = [d for d in range(updates.ndim) if d not in dn.update_window_dims]
    idx_batch = list(range(indices.ndim - 1)) if indices is not None else []
    for us, ib in zip(upd_scatter, idx_batch):
        if ib in dn.scatter_indices_batching_dims:
            od = dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(ib)]
            roles.append(Role(((UPD, us), (IDX, ib), (OP, od), (OUT, od))))
        elif op.name in _PARTIAL_OK:
            roles.append(Role(((UPD, us), (IDX, ib)), partial=True, scatter_ok=_PARTIAL_OK[op.name]))
    for od in dn.scatter_dims_to_operand_dims:
        if od in dn.inserted_window_dims:
            roles.append(Role(((OP, od), (OUT, od))))
    flops = float(op.flops) if op.flops else float(updates.size)
    return role_strategies(mesh, ins, outs, roles, flops, dtype=out.dtype)
