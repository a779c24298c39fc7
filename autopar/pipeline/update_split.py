"""Split a traced train step around its gradient op: what feeds the gradient (pre), the
gradient itself, and the rest (the optimizer update) assigned to pipeline stages.

An update op goes to the stage that holds its inputs (a parameter's update goes to the
stage that owns the parameter). Ops whose inputs belong to no stage (step counters,
learning-rate schedules) are recomputed wherever they are needed. If one op mixes values
of two stages (e.g. a global gradient-norm clip), the update is not splittable and runs as
one program on all pipeline devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from rockmate.graph import OpGraph


@dataclass(frozen=True)
class SubProgram:
    """Ops of the step graph (indices) with the vars they read and the vars wanted from them."""

    ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class StepSplit:
    """A train step cut around its single pipelined gradient op."""

    grad_op: int
    pre: SubProgram
    updates: tuple[SubProgram, ...] | None   # one per stage, or None when not splittable
    update_all: SubProgram                   # the whole update, for the fallback
    var_stage: dict[int, int]                # step var -> stage that holds it


def _program(graph: OpGraph, indices: Iterable[int], wanted: Sequence[int]) -> SubProgram:
    indices = tuple(indices)
    produced: set[int] = set()
    read: list[int] = []
    for i in indices:
        for v in graph.ops[i].inputs:
            if v not in produced and v not in graph.literals and v not in read:
                read.append(v)
        produced.update(graph.ops[i].outputs)
    return SubProgram(indices, tuple(read), tuple(v for v in dict.fromkeys(wanted) if v in produced))


def split_step(graph: OpGraph, grad_op: int, grad_in_stage: Sequence[int | None],
               grad_out_stage: Sequence[int], num_stages: int) -> StepSplit:
    """Cut `graph` around op `grad_op`.

    `grad_in_stage[k]`: stage owning the gradient op's k-th input (None for batch data);
    `grad_out_stage[k]`: stage holding its k-th output (loss, then gradients).
    """
    ops = graph.ops
    g = ops[grad_op]
    need = set(g.inputs)
    pre_idx = []
    for i in range(grad_op - 1, -1, -1):
        if need & set(ops[i].outputs):
            pre_idx.append(i)
            need.update(ops[i].inputs)
    pre_idx.reverse()
    pre_set = set(pre_idx)
    rest = [i for i in range(len(ops)) if i != grad_op and i not in pre_set]
    # pre also hands on what the update or the step's outputs read from it (the new key
    # of a jax.random.split whose other half feeds the loss)
    later = {v for i in rest for v in ops[i].inputs} | set(graph.outvars)
    pre = _program(graph, pre_idx, [*g.inputs, *(v for i in pre_idx for v in ops[i].outputs if v in later)])

    var_stage: dict[int, int] = {}
    for v, s in zip(g.inputs, grad_in_stage):
        if s is not None and v not in graph.literals:
            var_stage.setdefault(v, s)
    var_stage.update(zip(g.outputs, grad_out_stage))
    op_stage: dict[int, int | None] = {}
    splittable = True
    for i in rest:
        stages = {var_stage[v] for v in ops[i].inputs if v in var_stage}
        if len(stages) > 1:
            splittable = False
            break
        s = stages.pop() if stages else None
        op_stage[i] = s
        if s is not None:
            var_stage.update((v, s) for v in ops[i].outputs)
    update_all = _program(graph, rest, graph.outvars)
    if not splittable:
        return StepSplit(grad_op, pre, None, update_all, var_stage)
    # stage-less ops are recomputed in every stage program that needs them; stage-less
    # step outputs come from stage 0's program
    producer = {v: i for i in rest for v in ops[i].outputs}
    updates = []
    for s in range(num_stages):
        chosen = {i for i in rest if op_stage[i] == s}
        wanted = [v for v in graph.outvars
                  if v in producer and (op_stage[producer[v]] == s or (s == 0 and op_stage[producer[v]] is None))]
        stack = [producer[v] for v in wanted if op_stage[producer[v]] is None]
        stack += [producer[v] for i in chosen for v in ops[i].inputs if v in producer]
        while stack:
            i = stack.pop()
            if i in chosen:
                continue
            chosen.add(i)
            stack += [producer[v] for v in ops[i].inputs if v in producer]
        updates.append(_program(graph, sorted(chosen), wanted))
    return StepSplit(grad_op, pre, tuple(updates), update_all, var_stage)
