"""Search spaces: how one backend's schedules are drawn, checked and shown to the cost model.
The C backend's is the CPU sketch rules with loop-nest features; Pallas's is the GPU rules
(`search.sketch_pallas`) with kernel-plan features. A search policy takes one, so the same
evolutionary search tunes either backend."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from .compute import ComputeDAG
from .features import statement_features
from .features_pallas import kernel_features
from .mutation import checked_program
from .schedule import Step
from .sketch import Sketch, annotate, generate_sketches, sample_schedules
from .sketch_pallas import annotate_pallas, pallas_program, pallas_sketches

Features = list[dict]


@dataclass(frozen=True)
class SearchSpace:
    """Sketch rules, their annotation, and the features of a schedule (None when the schedule
    is not valid in this space)."""

    backend: str
    sketches: Callable[[ComputeDAG], list[Sketch]]
    annotate: Callable[[Sketch, ComputeDAG, random.Random], list[Step] | None]
    features: Callable[[ComputeDAG, list[Step]], Features | None]

    def sample(self, sketches: list[Sketch], dag: ComputeDAG, n: int, rng: random.Random) -> list[list[Step]]:
        """Up to n random valid schedules of random sketches."""
        return sample_schedules(sketches, dag, n, rng, self.annotate)


def _c_features(dag: ComputeDAG, steps: list[Step]) -> Features | None:
    prog = checked_program(dag, steps)
    return None if prog is None else statement_features(prog)


def _pallas_features(dag: ComputeDAG, steps: list[Step]) -> Features | None:
    prog = pallas_program(dag, steps)
    return None if prog is None else kernel_features(prog)


C_SPACE = SearchSpace("c", generate_sketches, annotate, _c_features)
PALLAS_SPACE = SearchSpace("pallas", pallas_sketches, annotate_pallas, _pallas_features)
SPACES = {"cpu": C_SPACE, "pallas": PALLAS_SPACE}  # by tune's target name
