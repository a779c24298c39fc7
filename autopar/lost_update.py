"""Refuse a train step that computes a gradient but returns nothing computed from it.

autopar, like `jax.jit`, runs a train step as a pure function of its arguments: the
arguments are flattened, traced and rebuilt, so what the step changes in place (an nnx
module updated by `nnx.Optimizer.update`, a dict assigned to) is changed in a copy that
is thrown away. A step written in the `nnx.jit` style (mutate the modules, return the
loss or nothing) therefore runs and trains nothing. This module finds that case and
says what to write instead.

The test is on the step's data flow: its gradient call, seen as one op while the step is
traced with `capture_grads` (the pipeline's trace), must have a gradient output on which
some output of the step depends. A step that only evaluates a loss, an inference step,
or a gradient the tracer cannot see (`jax.vjp`) is never refused. For single-program
methods the ordinary trace differentiates the loss inline; the second trace that shows
the gradient call is only made when that trace holds a dead matmul or convolution (the
weight-gradient matmuls of a backward pass whose result is dropped), so a step that
returns its update costs one linear pass over its graph.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from rockmate.graph import Op, OpGraph, trace_graph

_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_AUTOPAR_DIR = os.path.dirname(os.path.abspath(__file__))


class NoUpdateReturnedError(ValueError):
    """The train step computes a gradient, but none of its outputs depends on it."""


@dataclass(frozen=True)
class InPlaceChange:
    """An argument whose array leaves the step replaced in place while it was traced."""

    argnum: int
    type_name: str
    arrays: int

    def describe(self) -> str:
        return f"args[{self.argnum}] ({self.type_name}: {self.arrays} array{'s' * (self.arrays != 1)})"


def recording_in_place_changes(fun: Callable[..., Any]) -> tuple[Callable[..., Any], list[InPlaceChange]]:
    """`fun` wrapped so that each call records which positional arguments it changed in
    place (leaves of the argument's pytree that are other objects after the call), and
    that list, refilled by every call."""
    changes: list[InPlaceChange] = []

    @functools.wraps(fun)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        before = [jax.tree_util.tree_leaves(a) for a in args]
        out = fun(*args, **kwargs)
        changes.clear()
        for i, (arg, old) in enumerate(zip(args, before)):
            new = jax.tree_util.tree_leaves(arg)
            n = sum(a is not b for a, b in zip(new, old)) + abs(len(new) - len(old))
            if n:
                changes.append(InPlaceChange(i, type(arg).__name__, n))
        return out

    return recorded, changes


def live_vars(graph: OpGraph) -> set[int]:
    """Vars some output of the graph depends on (the outputs included)."""
    live = set(graph.outvars)
    for op in reversed(graph.ops):
        if any(v in live for v in op.outputs):
            live.update(op.inputs)
    return live


def has_dead_matmul(graph: OpGraph) -> bool:
    """Whether a matmul or convolution computes something no output depends on: what an
    inline backward pass whose gradients are dropped leaves in the traced step."""
    live = live_vars(graph)
    return any(op.name in _MATMULS and not any(v in live for v in op.outputs) for op in graph.ops)


def gradient_reaches_outputs(graph: OpGraph, grad_op: Op) -> bool:
    """Whether some output of the step depends on a gradient output of `grad_op` (the
    gradient call traced as one op: outputs loss, then the gradients)."""
    live = live_vars(graph)
    return any(v in live for v in grad_op.outputs[1:])


def refuse_unused_gradient(graph: OpGraph, grad_op: Op, changes: Sequence[InPlaceChange]) -> None:
    """Raise NoUpdateReturnedError when no output of the step depends on the gradient of
    `grad_op`; `changes` are the arguments the step changed in place, for the message."""
    if not gradient_reaches_outputs(graph, grad_op):
        raise NoUpdateReturnedError(no_update_message(grad_op.source, changes))


def no_update_message(source: str, changes: Sequence[InPlaceChange]) -> str:
    """What happened, why it trains nothing, and how to write the step instead."""
    # an editable install of autopar is "user code" to the tracer: its own frame says nothing
    where = f" (at {source})" if source and not source.startswith(_AUTOPAR_DIR + os.sep) else ""
    changed = ""
    if changes:
        changed = (f"; this step changed {', '.join(c.describe() for c in changes)} in place, "
                   f"and those changes are lost")
    return (
        f"autopar: the train step computes a gradient{where} but returns nothing computed from it, so running it "
        f"would train nothing. autopar, like jax.jit, runs the step as a pure function of its arguments: "
        f"changes it makes to them in place (nnx modules updated by nnx.Optimizer.update, the nnx.jit style) "
        f"are not seen outside it{changed}. Return the updated state from the step instead: with flax nnx, "
        f"split outside the step (graphdef, state = nnx.split((model, optimizer))), merge inside it "
        f"(model, optimizer = nnx.merge(graphdef, state)) and return nnx.state((model, optimizer)) beside the "
        f"loss, or return the updated model and optimizer themselves (model, optimizer, loss = step(model, "
        f"optimizer, batch)); with plain JAX and optax, return the new parameters and optimizer state, "
        f"e.g. ((params, opt_state), loss).")


def check_single_program_step(fun: Callable[..., Any], args: tuple, kwargs: dict, graph: OpGraph) -> None:
    """Refuse a step traced into `graph` (its gradient differentiated inline) that drops
    its gradient. Only a graph with a dead matmul is traced again, with the gradient call
    as one op; a step whose gradient the tracer cannot see, or whose second trace fails,
    is accepted as it is."""
    if not has_dead_matmul(graph):
        return
    from autopar.pipeline.grad import capture_grads, pipeline_grad_p

    recorded, changes = recording_in_place_changes(fun)
    try:
        with capture_grads():
            captured = trace_graph(recorded, *args, **kwargs)
    except Exception:      # the ordinary trace worked; this check never adds a failure of its own
        return
    grad_ops = [op for op in captured.ops if op.primitive is pipeline_grad_p]
    if grad_ops and not any(gradient_reaches_outputs(captured, op) for op in grad_ops):
        raise NoUpdateReturnedError(no_update_message(grad_ops[0].source, changes))
