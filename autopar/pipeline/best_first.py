"""Best-first search over candidates whose cost is known step by step: each step of a
candidate tightens a lower bound of its best latency and may find a plan (an upper bound).
The planner's candidates are (micro-batches, layering) pairs refined by the lazy stage DP;
the benchmark's grid points are refined in one step from bound to exact.

The candidate with the least lower bound is always the one refined next, and the search
stops when no bound beats the best plan found (divided by 1 + tolerance). A candidate is
thus refined only while it could still win, and only as far as needed to rule it out:
pricing one candidate exactly to the end before looking at the others (the obvious order)
spends most of the work on candidates whose first bounds were low but whose plans lose.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence


@dataclass(frozen=True)
class Refinement:
    """One step's knowledge of a candidate: a lower bound of its best latency, the latency
    of the best plan found for it so far (inf: none yet) and that plan; `done` when the
    lower bound is the candidate's optimum and `result` attains it."""

    lower_s: float
    upper_s: float = math.inf
    result: Any = None
    done: bool = False


@dataclass(frozen=True)
class BestFirstResult:
    """The chosen candidate, its plan's latency and the plan; `refined`: the candidates
    stepped past their first bound, in the order first refined."""

    candidate: Hashable
    latency_s: float
    result: Any
    refined: tuple[Hashable, ...]


def best_first(candidates: Sequence[Hashable], refine: Callable[[Hashable], Iterator[Refinement]],
               tolerance: float = 0.0) -> BestFirstResult:
    """The candidate with the least latency, to within `tolerance` (0: exact).

    refine(c) yields Refinements of c whose lower bounds never fall (a lower one is
    ignored). A candidate whose refinement raises ValueError (nothing fits) or stops
    without being done is dropped. Ties go to the earlier candidate."""
    order = {c: i for i, c in enumerate(candidates)}
    heap: list[tuple[float, int]] = []
    steps: dict[Hashable, Iterator[Refinement]] = {}
    best: tuple[float, int, Any] | None = None      # (latency, order, result)
    refined: list[Hashable] = []

    def advance(c: Hashable, lower: float) -> None:
        nonlocal best
        try:
            r = next(steps[c])
        except (ValueError, StopIteration):
            return
        if r.upper_s < math.inf and (best is None or (r.upper_s, order[c]) < (best[0] * (1 - 1e-12), best[1])):
            best = (r.upper_s, order[c], r.result)
        if not r.done:
            heapq.heappush(heap, (max(lower, r.lower_s), order[c]))

    for c in candidates:
        steps[c] = refine(c)
        advance(c, -math.inf)
    while heap:
        lower, i = heapq.heappop(heap)
        if best is not None and lower * (1 + tolerance) >= best[0]:
            break
        c = candidates[i]
        if c not in refined:
            refined.append(c)
        advance(c, lower)
    if best is None:
        raise ValueError("no pipeline fits the devices' memory for any number of micro-batches or layers")
    return BestFirstResult(candidate=candidates[best[1]], latency_s=best[0], result=best[2], refined=tuple(refined))


def bound_then_exact(lower_bound: Callable[[Hashable], float], exact: Callable[[Hashable], float]
                     ) -> Callable[[Hashable], Iterator[Refinement]]:
    """Refinement in one step for candidates with a cheap bound and a costly exact value:
    the bound, then (if the bound did not rise meanwhile, as others were priced) the exact
    value."""
    def refine(c: Hashable) -> Iterator[Refinement]:
        bound = lower_bound(c)
        yield Refinement(lower_s=bound)
        again = lower_bound(c)
        if again > bound * (1 + 1e-12):
            yield Refinement(lower_s=again)
        value = exact(c)
        yield Refinement(lower_s=value, upper_s=value, result=c, done=True)
    return refine
