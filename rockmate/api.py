"""Public entry points: remat, plan_remat, apply_plan, min_budget, block."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Mapping

import jax

from .blocks import BLOCK_PREFIX, find_chain
from .budget import parse_bytes
from .calibrate import program_temp_bytes
from .graph.signature import fingerprint
from .lowering import lower
from .plan import RematPlan
from .planner import analyze, make_plan, min_budget_of, trace


_ANALYSES: dict = {}


def _analysis(f, args, profile, ilp_time_limit_s=5.0, calibrate=True):
    """analyze() memoised per function, argument shapes and profile (planning is costly)."""
    leaves, tree = jax.tree.flatten(args)
    key = (id(f), tree, tuple((getattr(l, "shape", None), str(getattr(l, "dtype", type(l)))) for l in leaves),
           id(profile), ilp_time_limit_s, calibrate)
    hit = _ANALYSES.get(key)
    if hit is None or hit[0] is not f:
        if len(_ANALYSES) > 16:
            _ANALYSES.clear()
        hit = (f, analyze(f, args, profile, ilp_time_limit_s, calibrate))
        _ANALYSES[key] = hit
    return hit[1]


def plan_remat(f: Callable, memory_budget: int | str, *example_args,
               profile: Mapping[str, float] | None = None,
               ilp_time_limit_s: float = 5.0, calibrate: bool = True) -> RematPlan:
    """Plan rematerialization of f(*example_args) so forward+backward temp memory fits the budget.

    `profile` maps op keys (see `rockmate.op_costs.op_key`) to measured seconds; roofline
    estimates are used for the rest. `calibrate` compiles each distinct block twice to
    measure XLA's working memory (accurate predictions; off = analytic model only).
    Raises InfeasibleBudgetError below the minimum.
    """
    budget = parse_bytes(memory_budget)
    return make_plan(_analysis(f, example_args, profile, ilp_time_limit_s, calibrate), budget)


def min_budget(f: Callable, *example_args, profile: Mapping[str, float] | None = None,
               calibrate: bool = True) -> int:
    """Smallest temp memory (bytes) that any schedule of f reaches, as predicted."""
    return min_budget_of(_analysis(f, example_args, profile, calibrate=calibrate))


class RematFunction:
    """f with a remat schedule applied; call it like f, differentiate it with jax.grad."""

    def __init__(self, f: Callable, plan: RematPlan, boundary_conds: bool = True):
        self._f = f
        self.schedule = plan
        self._boundary_conds = boundary_conds
        self._cache: dict = {}
        functools.update_wrapper(self, f)

    def _lowered(self, args, kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        key = (treedef, tuple((getattr(l, "shape", None), str(getattr(l, "dtype", type(l))))
                              for l in leaves))
        if key not in self._cache:
            program = trace(self._f, args, kwargs)
            if fingerprint(program) != self.schedule.fingerprint:
                raise ValueError(
                    "this remat plan was made for a different program (other shapes, dtypes or "
                    "model structure); call rockmate.plan_remat again with the new arguments")
            self._cache[key] = (lower(program, find_chain(program), dict(enumerate(self.schedule.blocks)),
                                      self.schedule.schedule, self._boundary_conds), program.out_tree)
        return leaves, self._cache[key]

    def __call__(self, *args, **kwargs):
        leaves, (run, out_tree) = self._lowered(args, kwargs)
        return jax.tree.unflatten(out_tree, run(*leaves))


def apply_plan(f: Callable, plan: RematPlan | dict, *, boundary_conds: bool = True) -> RematFunction:
    """f with `plan` (or its JSON dict) applied; its values and gradients equal f's.

    `boundary_conds=False`: no `cond` around block outputs and input cotangents (they stop
    XLA from fusing across blocks, but an SPMD planner may not shard through them)."""
    if isinstance(plan, dict):
        plan = RematPlan.from_json(plan)
    return RematFunction(f, plan, boundary_conds)


# A compiled program within this share of its budget counts as fitting (XLA's scratch
# moves by a few KB between otherwise equal schedules).
BUDGET_SLACK = 0.01
REPLANS = 2  # extra plans at a lower budget when the compiled program measures over


def remat(f: Callable, memory_budget: int | str, *example_args,
          profile: Mapping[str, float] | None = None, calibrate: bool = True) -> RematFunction:
    """f rescheduled so its forward+backward temp memory fits `memory_budget` at least recompute.

    The result has `.schedule` (a RematPlan: per-block kept values, predicted time and memory).
    With `calibrate`, the scheduled program is compiled once and its temp bytes recorded in
    `.schedule.measured_temp_bytes`; while over budget it is re-planned for the prediction
    lowered by the overshoot (at most REPLANS times), and a program that still does not fit
    gets a warning saying by how much.
    """
    budget = parse_bytes(memory_budget)
    plan = plan_remat(f, budget, *example_args, profile=profile, calibrate=calibrate)
    if not calibrate:
        return apply_plan(f, plan)
    best = None
    for _ in range(REPLANS + 1):
        measured = program_temp_bytes(apply_plan(f, plan), example_args)
        plan = dataclasses.replace(plan, budget_bytes=budget, measured_temp_bytes=measured)
        if best is None or measured < best.measured_temp_bytes:
            best = plan
        if measured <= budget * (1 + BUDGET_SLACK):
            break
        target = plan.predicted_temp_bytes - (measured - budget)  # what fits if the overshoot stays
        if target < plan.min_budget_bytes:
            break
        plan = plan_remat(f, target, *example_args, profile=profile, calibrate=calibrate)
    if best.measured_temp_bytes > budget * (1 + BUDGET_SLACK):
        warnings.warn(
            f"rockmate.remat: the compiled forward+backward of {getattr(f, '__name__', 'f')} needs "
            f"{best.measured_temp_bytes / 1e6:.2f} MB of temp memory, "
            f"{100 * (best.measured_temp_bytes / budget - 1):.1f} % over the budget of {budget / 1e6:.2f} MB "
            f"(predicted {best.predicted_temp_bytes / 1e6:.2f} MB; the least rockmate plans for is "
            f"{best.min_budget_bytes / 1e6:.2f} MB). Raise the budget by "
            f"{(best.measured_temp_bytes - budget) / 1e6:.2f} MB or cut the batch.", stacklevel=2)
    return apply_plan(f, best)


def block(fn: Callable, **jit_kwargs) -> Callable:
    """Mark `fn` as one rematerialization block (a unit rockmate keeps or recomputes whole)."""
    def marked(*args, **kwargs):
        return fn(*args, **kwargs)
    marked.__name__ = f"{BLOCK_PREFIX}_{getattr(fn, '__name__', 'fn')}"
    marked.__qualname__ = marked.__name__
    return jax.jit(marked, **jit_kwargs)
