"""Trace a train step for pipelining: the whole step at the full batch with its gradient
call left as one op, and the loss on one micro-batch, both as op graphs.

The loss is found through the step's `jax.value_and_grad` / `jax.grad` call, or an
`autopar.value_and_grad` marker (see `grad.py`). To get
it at micro-batch size the step is traced a second time with its batch arguments cut to
one micro-batch: whatever the loss closes over (a batch captured by a lambda, a mask built
from it) then has micro-batch shapes too. Which loss inputs are split into micro-batches
follows from the full-batch trace: those computed from the batch arguments whose leading
dimension is B times the micro-batch's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from autopar.interface import abstract
from autopar.lost_update import recording_in_place_changes, refuse_unused_gradient
from autopar.pipeline.grad import GradCall, LossCaptured, capture_grads, pipeline_grad_p
from rockmate.graph import OpGraph, graph_from_jaxpr, trace_graph


@dataclass(frozen=True)
class TracedStep:
    """A train step ready to be cut into pipeline stages.

    `step` computes the step at the full batch; its op `grad_op` is the gradient call,
    whose inputs are the loss's inputs (closed-over values first) and whose outputs are
    the loss and the gradients of the differentiated inputs, in input order. `loss`
    computes the scalar loss of one micro-batch from the same inputs, at micro-batch
    shapes (custom_jvp/custom_vjp calls kept whole)."""

    step: OpGraph
    grad_op: int
    loss: OpGraph
    diff_mask: tuple[bool, ...]     # per loss input: a differentiated parameter?
    split_mask: tuple[bool, ...]    # per loss input: split into micro-batches along axis 0?
    num_micro_batches: int
    call: GradCall
    loss_jaxpr: Any = None          # the micro-batch loss as traced (`loss` is built from it)

    @property
    def micro_batch_size(self) -> int | None:
        """Leading dimension of the split loss inputs (None when nothing is split)."""
        sizes = {self.loss.vars[v].shape[0] for v, s in zip(self.loss.invars, self.split_mask) if s}
        return min(sizes) if sizes else None


def _trace_with_grad(fun: Callable, args: Sequence[Any]) -> tuple[OpGraph, int, GradCall]:
    """The step with its one gradient call as one op; refused when no output depends on
    the gradient (an nnx.jit-style step, which would train nothing)."""
    recorded, changes = recording_in_place_changes(fun)
    with capture_grads() as calls:
        graph = trace_graph(recorded, *args)
        found = [op.index for op in graph.ops if op.primitive is pipeline_grad_p]
        if len(found) != 1 or len(calls) != 1:
            raise ValueError(
                f"PipeshardParallel needs the train step to compute its gradient with exactly one "
                f"jax.value_and_grad / jax.grad call (or a wrapper of them: nnx.value_and_grad, "
                f"eqx.filter_value_and_grad, autopar.value_and_grad), outside any jit, scan or loop; "
                f"found {len(found)}. A gradient from jax.vjp or a custom transformation is invisible: "
                f"wrap the loss in autopar.value_and_grad to mark it")
        call = calls[0]
    refuse_unused_gradient(graph, graph.ops[found[0]], changes)
    return graph, found[0], call


def _batch_derived(graph: OpGraph, batch_inputs: set[int]) -> set[int]:
    """Vars computed (transitively) from the given graph inputs."""
    derived = set(batch_inputs)
    for op in graph.ops:
        if any(v in derived for v in op.inputs):
            derived.update(op.outputs)
    return derived


class MicroBatchTraceError(ValueError):
    """The train step fails to trace when its batch is cut into this many micro-batches."""


class StepTracer:
    """Traces of one train step for the pipeline planner: the whole step at the full batch
    (once), and its loss at any number of micro-batches (cached). Lives as long as one
    planning run."""

    def __init__(self, fun: Callable[..., Any], args: Sequence[Any], batch_argnums: Sequence[int] = (1,)):
        self.fun = fun
        self.args = jax.tree_util.tree_map(abstract, tuple(args))
        self.batch_argnums = tuple(batch_argnums)
        self.step, self.grad_op, self.call = _trace_with_grad(fun, self.args)
        offsets = [0]
        for a in self.args:
            offsets.append(offsets[-1] + len(jax.tree_util.tree_leaves(a)))
        batch_inputs = {self.step.invars[k] for i in self.batch_argnums if i < len(self.args)
                        for k in range(offsets[i], offsets[i + 1])}
        self._derived = _batch_derived(self.step, batch_inputs)
        self._traced: dict[int, TracedStep] = {}
        self._failed: dict[int, MicroBatchTraceError] = {}

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Leading dimensions of the batch arguments' leaves."""
        return tuple(sorted({leaf.shape[0] for i in self.batch_argnums if i < len(self.args)
                             for leaf in jax.tree_util.tree_leaves(self.args[i]) if leaf.shape}))

    def micro_batch_counts(self) -> list[int]:
        """Every B that divides all batch dimensions."""
        sizes = self.batch_sizes
        if not sizes:
            return [1]
        return [b for b in range(1, min(sizes) + 1) if all(s % b == 0 for s in sizes)]

    @property
    def traced_counts(self) -> set[int]:
        """The numbers of micro-batches traced so far."""
        return set(self._traced)

    def at(self, num_micro_batches: int) -> TracedStep:
        """The step with its loss traced on one of `num_micro_batches` micro-batches.

        A step that cannot be traced on micro-batches that small (a model that reshapes
        its tokens into groups of a fixed size) raises MicroBatchTraceError, a ValueError:
        the planner drops that number of micro-batches."""
        if num_micro_batches not in self._traced:
            if num_micro_batches in self._failed:
                raise self._failed[num_micro_batches]
            try:
                self._traced[num_micro_batches] = self._trace(num_micro_batches)
            except MicroBatchTraceError as e:
                self._failed[num_micro_batches] = e
                raise
        return self._traced[num_micro_batches]

    def _trace(self, B: int) -> TracedStep:
        micro_args = []
        for i, a in enumerate(self.args):
            if i not in self.batch_argnums:
                micro_args.append(a)
                continue
            for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
                if not leaf.shape or leaf.shape[0] % B:
                    raise ValueError(
                        f"batch argument args[{i}]{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}: its "
                        f"leading dimension must be divisible by num_micro_batches={B}; use a batch size that is "
                        f"a multiple of {B} or another number of micro-batches")
            micro_args.append(jax.tree_util.tree_map(
                lambda l: jax.ShapeDtypeStruct((l.shape[0] // B, *l.shape[1:]), l.dtype), a))
        if B == 1:
            call = self.call
        else:
            with capture_grads(stop=True) as calls:
                try:
                    trace_graph(self.fun, *micro_args)
                except LossCaptured:
                    pass
                except Exception as e:       # the user's code failed on the smaller shapes
                    sizes = "/".join(str(s // B) for s in self.batch_sizes)
                    raise MicroBatchTraceError(
                        f"the step cannot be traced on {B} micro-batches (batch {sizes} each): "
                        f"{type(e).__name__}: {e}; use fewer micro-batches (num_micro_batches='auto' skips these)"
                    ) from e
            call = calls[0]
        loss = graph_from_jaxpr(call.loss_jaxpr, keep_custom_rules=True)
        grad = self.step.ops[self.grad_op]
        if len(loss.invars) != len(grad.inputs):
            raise ValueError("the loss closes over different values at the full batch and at one micro-batch; "
                             "pass the batch to the loss as an argument instead of building it from the batch size")
        split = []
        for k, (v, w, diff) in enumerate(zip(grad.inputs, loss.invars, self.call.diff_leaf_mask)):
            full, micro = self.step.vars[v], loss.vars[w]
            cut = (not diff and v in self._derived and full.ndim > 0 and full.shape[0] == B * micro.shape[0]
                   and full.shape[1:] == micro.shape[1:])
            if not cut and full.shape != micro.shape:
                raise ValueError(
                    f"loss input {k} has shape {full.shape} at the full batch and {micro.shape} on one "
                    f"micro-batch: it depends on the batch size, but not as a leading batch dimension; "
                    f"give the loss its batch with the batch dimension first")
            split.append(cut)
        return TracedStep(self.step, self.grad_op, loss, tuple(self.call.diff_leaf_mask), tuple(split), B, self.call,
                          call.loss_jaxpr)


def trace_step(fun: Callable[..., Any], args: Sequence[Any], num_micro_batches: int,
               batch_argnums: Sequence[int] = (1,)) -> TracedStep:
    """Trace `fun(*args)` at the full batch and its loss at one micro-batch."""
    return StepTracer(fun, args, batch_argnums).at(num_micro_batches)
