"""Alpa-style sharding strategies for every primitive of a train step on a 2-D mesh.

`enumerate_strategies(op, graph, mesh)` lists the valid ways to run one op: operand and
result layouts (`DimSharding`), the roofline compute time of the local shard and the
collectives the op itself performs. Rules live in one module per primitive family;
unknown primitives get one replicated strategy and a warning. The function is pure; a
planning run memoises it per (primitive, shapes, params, mesh) in its
`autopar.sharding_costs.ShardingCosts`, so a 10k-op graph enumerates in well under a
second once its few distinct layers have been seen.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from rockmate.graph.op_graph import Op, OpGraph, TensorSpec
from autopar.sharding_spec import Strategy
from autopar.strategies import conv, dot, elementwise, indexing, reduce, shape_ops
from autopar.strategies.layouts import replicated_strategy

Rule = Callable[[Op, tuple, tuple, Any], list[Strategy]]

RULES: dict[str, Rule] = {"dot_general": dot.dot_general_strategies}
RULES.update({p: elementwise.elementwise_strategies for p in elementwise.ELEMENTWISE_PRIMITIVES})
# checkpoint_name (the `name` primitive) is an identity that rockmate's rescheduled loss leaves in
# the step; without a rule it would be planned replicated and drag the activations along
RULES["name"] = elementwise.elementwise_strategies
RULES.update({p: reduce.reduce_strategies for p in reduce.REDUCE_PRIMITIVES})
RULES.update({p: reduce.arg_reduce_strategies for p in reduce.ARG_REDUCE_PRIMITIVES})
RULES.update({p: reduce.cumulative_strategies for p in reduce.CUMULATIVE_PRIMITIVES})
RULES.update({p: reduce.window_strategies for p in reduce.WINDOW_PRIMITIVES})
RULES.update({
    "sort": reduce.sort_strategies,
    "top_k": reduce.top_k_strategies,
    "broadcast_in_dim": shape_ops.broadcast_in_dim_strategies,
    "reshape": shape_ops.reshape_strategies,
    "expand_dims": shape_ops.expand_dims_strategies,
    "transpose": shape_ops.transpose_strategies,
    "squeeze": shape_ops.squeeze_strategies,
    "concatenate": shape_ops.concatenate_strategies,
    "split": shape_ops.split_strategies,
    "slice": shape_ops.slice_strategies,
    "dynamic_slice": shape_ops.dynamic_slice_strategies,
    "dynamic_update_slice": shape_ops.dynamic_update_slice_strategies,
    "pad": shape_ops.pad_strategies,
    "rev": shape_ops.rev_strategies,
    "iota": shape_ops.iota_strategies,
    "gather": indexing.gather_strategies,
    "conv_general_dilated": conv.conv_strategies,
})
RULES.update({p: indexing.scatter_strategies for p in indexing.SCATTER_PRIMITIVES})

# Ops planned whole on every device on purpose (no warning): control flow whose bodies are
# planned elsewhere or not at all, and random-number generation whose bits must not depend
# on the layout.
REPLICATED_PRIMITIVES = frozenset("""
while cond scan pjit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr
remat checkpoint rng_bit_generator random_bits random_seed random_wrap random_unwrap random_split
random_fold_in rng_uniform optimization_barrier
""".split())

CONTROL_FLOW = frozenset({"while", "cond"})

FOLLOWER_PRIMITIVES = elementwise.UNARY_FOLLOWERS | frozenset(
    ["reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim"])

_warned: set[str] = set()


def enumerate_strategies(op: Op, graph: OpGraph, mesh: Any) -> list[Strategy]:
    """Every valid strategy of `op` on `mesh` (a LogicalMesh); never empty."""
    ins = tuple(None if v in graph.literals else graph.vars[v] for v in op.inputs)
    outs = tuple(graph.vars[v] for v in op.outputs)
    return _enumerate(op, ins, outs, mesh)


def _enumerate(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
               mesh: Any) -> list[Strategy]:
    if ins and all(t is None for t in ins):   # computes on literals only: a constant
        return [replicated_strategy(mesh, ins, outs, float(op.flops))]
    if op.name in CONTROL_FLOW and op.name not in _warned:
        _warned.add(op.name)
        warnings.warn(f"autopar: a `{op.name}` in the step is planned replicated: its operands are gathered "
                      f"on every device and its body runs whole there (this can cost much memory); write the "
                      f"loop as lax.scan (planned per iteration) or move it out of the step", stacklevel=3)
    rule = RULES.get(op.name)
    if rule is None or op.name in REPLICATED_PRIMITIVES:
        if op.name not in REPLICATED_PRIMITIVES and op.name not in _warned:
            _warned.add(op.name)
            warnings.warn(f"autopar: no sharding rule for primitive '{op.name}'; it is planned replicated",
                          stacklevel=3)
        return [replicated_strategy(mesh, ins, outs, float(op.flops))]
    try:
        strategies = rule(op, ins, outs, mesh)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # an op form the rule does not know (unusual params): plan it replicated, say so once
        key = f"{op.name}:{type(e).__name__}"
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"autopar: sharding rule for primitive '{op.name}' failed on operand shapes "
                f"{[None if t is None else t.shape for t in ins]} ({type(e).__name__}: {e}); "
                f"it is planned replicated", stacklevel=3)
        return [replicated_strategy(mesh, ins, outs, float(op.flops))]
    if not any(all(not s or not any(s) for s in st.out_specs) and
               all(s is None or not any(s) for s in st.in_specs) for st in strategies):
        strategies = [replicated_strategy(mesh, ins, outs, float(op.flops)), *strategies]
    return strategies


def is_follower(op: Op, graph: OpGraph | None = None) -> bool:
    """True for ops whose layout can simply follow their operand 0 (unary elementwise,
    converts, reshape/transpose/broadcast/squeeze): the ILP may merge them into it. With a
    graph, also binary elementwise ops whose other operands are literals or rank 0."""
    if op.name in FOLLOWER_PRIMITIVES:
        return True
    if graph is None or op.name not in elementwise.ELEMENTWISE_PRIMITIVES:
        return False
    big = [v for v in op.inputs if v not in graph.literals and graph.vars[v].ndim > 0]
    return len(big) == 1


__all__ = ["enumerate_strategies", "is_follower", "RULES"]
