"""conv_general_dilated: split the batch, the output features, or the input features
(partial sums: all-reduce or reduce-scatter), with dims read from the dimension numbers,
so NHWC/NCHW and the transposed convolutions of the backward pass all work. Grouped
(depthwise) convolutions split whole groups: input and output features together; the
weight gradient of a grouped convolution (batch_group_count > 1) splits whole batch
groups together with the output features. Spatial
dims are never split (that would need halo exchange)."""
from __future__ import annotations

from typing import Any

from rockmate.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy
from autopar.strategies.layouts import replicated_strategy
from autopar.strategies.roles import Role, role_strategies


def conv_strategies(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
                    mesh: Any) -> list[Strategy]:
    lhs, rhs = ins
    out = outs[0]
    p = op.params
    dn = p["dimension_numbers"]
    groups, batch_groups = int(p.get("feature_group_count", 1)), int(p.get("batch_group_count", 1))
    flops = float(op.flops) if op.flops else 2.0 * out.size * (rhs.size / rhs.shape[dn.rhs_spec[0]])
    if lhs is None or rhs is None:
        return [replicated_strategy(mesh, ins, outs, flops)]
    LHS, RHS, OUT = 0, 1, 2
    ln, lc = dn.lhs_spec[0], dn.lhs_spec[1]
    ro, ri = dn.rhs_spec[0], dn.rhs_spec[1]
    on, oc = dn.out_spec[0], dn.out_spec[1]
    roles: list[Role] = []
    if batch_groups == 1:
        roles.append(Role(((LHS, ln), (OUT, on))))
    else:  # grouped weight gradient: lhs batch groups pair with output features
        roles.append(Role(((LHS, ln), (RHS, ro), (OUT, oc)), group_size=batch_groups))
    if groups == 1 and batch_groups == 1:
        roles.append(Role(((RHS, ro), (OUT, oc))))
    if groups == 1 and batch_groups == 1:
        # (not with batch groups: XLA 0.10's SPMD partitioner double-counts that case)
        roles.append(Role(((LHS, lc), (RHS, ri)), partial=True))
    elif groups > 1:
        roles.append(Role(((LHS, lc), (RHS, ro), (OUT, oc)), group_size=groups))
    return role_strategies(mesh, ins, outs, roles, flops, dtype=lhs.dtype)
