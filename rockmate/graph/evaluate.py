"""Run an OpGraph by binding its primitives in order (eagerly or under jax.jit).

The lowering uses the `on_output` hook to put sharding constraints on chosen values.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from rockmate.graph.op_graph import Op, OpGraph

OutputHook = Callable[[Op, int, Any], Any]


OpOverride = Callable[[list], list]


def eval_graph(graph: OpGraph, flat_args: Sequence[Any], on_output: OutputHook | None = None,
               overrides: Mapping[int, OpOverride] | None = None) -> list[Any]:
    """Evaluate `graph` on flat arguments; return the flat outputs.

    `on_output(op, var_id, value) -> value` sees every output of every top-level op and
    may replace it (e.g. with `jax.lax.with_sharding_constraint(value, ...)`). Ops inside
    a scan body are not visited: the scan is bound whole with its original params.
    `overrides[i](inputs) -> outputs` computes op i instead of its primitive (e.g. a tuned
    kernel for the same op).
    """
    if len(flat_args) != len(graph.invars):
        raise ValueError(
            f"eval_graph: the graph takes {len(graph.invars)} flat arguments, got {len(flat_args)}; "
            "flatten (args, kwargs) with jax.tree_util.tree_leaves, as trace_graph did."
        )
    env: dict[int, Any] = dict(zip(graph.invars, flat_args))
    eval_ops(graph, env, on_output=on_output, overrides=overrides)
    return [env[v] if v in env else graph.literals[v] for v in graph.outvars]


def eval_ops(graph: OpGraph, env: dict[int, Any], ops: Iterable[int] | None = None,
             on_output: OutputHook | None = None, overrides: Mapping[int, OpOverride] | None = None) -> None:
    """Evaluate the ops at indices `ops` (default: all, in order), reading operands from
    `env` (var id -> value; literals come from `graph.literals`) and writing every result
    into `env`. Planners that run a graph piece by piece call this: rockmate re-runs a
    block inside a checkpointed region, a pipeline stage runs its layers' forward or
    backward ops; `on_output` is as in `eval_graph`."""
    literals = graph.literals
    for i in range(len(graph.ops)) if ops is None else ops:
        op = graph.ops[i]
        args = [env[v] if v in env else literals[v] for v in op.inputs]
        if overrides and i in overrides:
            outs = overrides[i](args)
        else:
            outs = op.primitive.bind(*args, **op.primitive.get_bind_params(op.params))
            if not op.primitive.multiple_results:
                outs = (outs,)
        for vid, value in zip(op.outputs, outs):
            env[vid] = on_output(op, vid, value) if on_output is not None else value


def call_graph(graph: OpGraph, *args: Any, on_output: OutputHook | None = None, **kwargs: Any) -> Any:
    """Call a traced graph like the original function: pytree in, pytree out."""
    flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    if graph.in_tree is not None and in_tree != graph.in_tree:
        raise ValueError(
            f"call_graph: arguments have structure {in_tree}, but the graph was traced with "
            f"{graph.in_tree}; pass arguments shaped like the ones given to trace_graph."
        )
    flat_out = eval_graph(graph, flat_args, on_output)
    return jax.tree_util.tree_unflatten(graph.out_tree, flat_out) if graph.out_tree is not None else flat_out
