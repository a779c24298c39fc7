"""Split a traced train step around its gradient call: what feeds the gradient (pre),
the gradient itself, and the rest (the optimizer update) assigned to pipeline stages.

An update equation goes to the stage that holds its inputs (a parameter's update goes to
the stage that owns the parameter). Equations whose inputs belong to no stage (step
counters, learning-rate schedules) are recomputed wherever they are needed. If one
equation mixes values of two stages (e.g. a global gradient-norm clip), the update is
not splittable and runs as one program on all pipeline devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from jax.extend import core as jcore


@dataclass(frozen=True)
class SubProgram:
    """Equations (indices into the step jaxpr) with the variables they read and write."""

    eqn_indices: tuple[int, ...]
    invars: tuple[Any, ...]
    outvars: tuple[Any, ...]


@dataclass(frozen=True)
class StepSplit:
    """A train step cut around its single pipelined gradient equation."""

    grad_eqn_index: int
    pre: SubProgram
    updates: tuple[SubProgram, ...] | None   # one per stage, or None when not splittable
    update_all: SubProgram                   # the whole update, for the fallback
    var_stage: dict[Any, int]                # step variable -> stage that holds it


def _vars(seq):
    return [v for v in seq if isinstance(v, jcore.Var) and not isinstance(v, jcore.DropVar)]


def _program(eqns, indices, needed_out) -> SubProgram:
    produced, read = set(), []
    for i in indices:
        for v in _vars(eqns[i].invars):
            if v not in produced and v not in read:
                read.append(v)
        produced.update(_vars(eqns[i].outvars))
    outs = [v for v in dict.fromkeys(needed_out) if v in produced]
    return SubProgram(tuple(indices), tuple(read), tuple(outs))


def split_step(jaxpr: Any, grad_eqn_index: int, grad_in_stage: Sequence[int | None],
               grad_out_stage: Sequence[int], num_stages: int) -> StepSplit:
    """Cut `jaxpr` around equation `grad_eqn_index`.

    `grad_in_stage[k]`: stage owning the gradient equation's k-th input (None for batch
    data); `grad_out_stage[k]`: stage holding its k-th output (loss, then gradients).
    """
    eqns = jaxpr.eqns
    g = eqns[grad_eqn_index]
    # pre: ancestors of the gradient equation's inputs
    need = set(_vars(g.invars))
    pre_idx = []
    for i in range(grad_eqn_index - 1, -1, -1):
        if need & set(_vars(eqns[i].outvars)):
            pre_idx.append(i)
            need.update(_vars(eqns[i].invars))
    pre_idx.reverse()
    pre = _program(eqns, pre_idx, _vars(g.invars))
    rest = [i for i in range(len(eqns)) if i != grad_eqn_index and i not in set(pre_idx)]

    var_stage: dict[Any, int] = {}
    for v, s in zip(g.invars, grad_in_stage):
        if isinstance(v, jcore.Var) and s is not None:
            var_stage.setdefault(v, s)
    for v, s in zip(g.outvars, grad_out_stage):
        if not isinstance(v, jcore.DropVar):
            var_stage[v] = s
    eqn_stage: dict[int, int | None] = {}
    splittable = True
    for i in rest:
        stages = {var_stage[v] for v in _vars(eqns[i].invars) if v in var_stage}
        if len(stages) > 1:
            splittable = False
            break
        s = stages.pop() if stages else None
        eqn_stage[i] = s
        if s is not None:
            for v in _vars(eqns[i].outvars):
                var_stage[v] = s
    needed_out = list(jaxpr.outvars)
    update_all = _program(eqns, rest, needed_out)
    if not splittable:
        return StepSplit(grad_eqn_index, pre, None, update_all, var_stage)
    # free (stage-less) equations: recompute them in every stage program that needs them;
    # free step outputs are produced by stage 0's program.
    producer = {v: i for i in rest for v in _vars(eqns[i].outvars)}
    updates = []
    for s in range(num_stages):
        chosen = {i for i in rest if eqn_stage[i] == s}
        wanted = [v for v in _vars(jaxpr.outvars)
                  if v in producer and (eqn_stage[producer[v]] == s or
                                        (s == 0 and eqn_stage[producer[v]] is None))]
        stack = [producer[v] for v in wanted if eqn_stage[producer[v]] is None]
        stack += [producer[v] for i in chosen for v in _vars(eqns[i].invars) if v in producer]
        while stack:
            i = stack.pop()
            if i in chosen:
                continue
            chosen.add(i)
            stack += [producer[v] for v in _vars(eqns[i].invars) if v in producer]
        updates.append(_program(eqns, sorted(chosen), wanted))
    return StepSplit(grad_eqn_index, pre, tuple(updates), update_all, var_stage)
