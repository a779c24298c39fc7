"""Search policies behind one interface: `next_batch(n) -> schedules`, `update(schedules, records)`.

EvolutionarySearch is Ansor's policy: a population from random annotations of the sketches
plus the best measured schedules, evolved for a few generations by mutation and crossover
with selection by cost-model score; the batch to measure is the best predicted unmeasured
schedules plus an epsilon share of random ones; the model is retrained after each batch.
RandomSearch measures random annotations of random sketches."""
from __future__ import annotations

import json
import math
import random
from typing import Protocol, Sequence

from cost_model import XGBoostCostModel

from .measure import best_run_s
from .mutation import crossover, mutate, structure, tiling
from .record import TuningRecord
from .schedule import Step
from .space import C_SPACE, SearchSpace
from .task import Task


TRANSFER_PER_TASK = 128  # records of each other task used to pre-train the model
TILING_REPEATS = 3       # measured variants of one tiling after which the model's picks skip it
SCREEN_SHARE = 0.25      # share of a batch screened by the model from new random schedules
SCREEN_POOL = 256        # new random schedules the model screens for those slots


def schedule_key(steps: list[Step]) -> str:
    return json.dumps(steps, sort_keys=True)


class SearchPolicy(Protocol):
    def next_batch(self, n: int) -> list[list[Step]]: ...
    def update(self, schedules: Sequence[list[Step]], records: Sequence[TuningRecord]) -> None: ...


class RandomSearch:
    """Baseline: random annotations of random sketches, never measuring one twice."""

    def __init__(self, task: Task, seed: int = 0, space: SearchSpace = C_SPACE):
        self.task, self.space = task, space
        self.rng = random.Random(seed)
        self.sketches = space.sketches(task.dag)
        self.measured: set[str] = set()

    def next_batch(self, n: int) -> list[list[Step]]:
        out: list[list[Step]] = []
        for _ in range(4):
            for s in self.space.sample(self.sketches, self.task.dag, n, self.rng):
                k = schedule_key(s)
                if k not in self.measured and len(out) < n:
                    self.measured.add(k)
                    out.append(s)
            if len(out) >= n:
                break
        return out

    def update(self, schedules, records) -> None:
        self.measured.update(schedule_key(s) for s in schedules)


class EvolutionarySearch:
    """Ansor's evolutionary search guided by a learned cost model."""

    def __init__(self, task: Task, cost_model: XGBoostCostModel | None = None, seed: int = 0,
                 population: int = 128, generations: int = 4, eps_greedy: float = 0.1,
                 mutation_prob: float = 0.85, elite: int = 16, screen_share: float = SCREEN_SHARE,
                 screen_pool: int = SCREEN_POOL, space: SearchSpace = C_SPACE):
        self.task, self.space = task, space
        self.model = cost_model if cost_model is not None else XGBoostCostModel(seed=seed)
        self.rng = random.Random(seed)
        self.sketches = space.sketches(task.dag)
        self.population, self.generations = population, generations
        self.eps_greedy, self.mutation_prob, self.elite = eps_greedy, mutation_prob, elite
        self.screen_share, self.screen_pool = screen_share, screen_pool
        self.measured: dict[str, float] = {}   # schedule key -> latency (inf when failed)
        self.best: list[tuple[float, list[Step]]] = []
        self.sketch_best: dict[tuple, float] = {}  # structure -> best latency measured (inf: all failed)
        self.tiling_count: dict[tuple, int] = {}   # tiling -> schedules measured with it
        self._features: dict[str, list[dict[str, float]]] = {}

    @property
    def own_samples(self) -> int:
        """Measurements of this task the cost model is trained on."""
        return self.model.n_samples_of(self.task.workload_key)

    # ---- cost model ----
    def features(self, steps: list[Step]) -> list[dict[str, float]]:
        k = schedule_key(steps)
        if k not in self._features:
            feats = self.space.features(self.task.dag, steps)
            if feats is None:
                raise ValueError(f"invalid schedule for the {self.space.backend} backend")
            self._features[k] = feats
        return self._features[k]

    def valid(self, steps: list[Step]) -> bool:
        """Whether a schedule is valid in this policy's space (mutations only check that it lowers)."""
        try:
            self.features(steps)
        except ValueError:
            return False
        return True

    def learn_from(self, records: Sequence[TuningRecord], per_task: int = TRANSFER_PER_TASK) -> int:
        """Train the cost model on measured records of *other* tasks, one ranking group per
        task (Ansor keeps one model per tuning job). They join this task's own records in every
        refit; the trees rank this task's candidates once it has measurements of its own (see
        `scores`). Uses each task's best `per_task` records plus an even spread of the rest;
        returns how many were used."""
        by_task: dict[str, list[TuningRecord]] = {}
        for r in records:
            if r.ok and r.workload_key != self.task.workload_key:
                by_task.setdefault(r.workload_key, []).append(r)
        feats, lats, groups = [], [], []
        for key, recs in by_task.items():
            recs.sort(key=best_run_s)
            if len(recs) > per_task:  # the best half, then every k-th of the rest
                half = per_task // 2
                rest = recs[half:]
                recs = recs[:half] + rest[::max(1, len(rest) // (per_task - half))][:per_task - half]
            try:
                dag = Task.from_dict(recs[0].task).dag
            except Exception:
                continue  # a task this library version cannot build
            for r in recs:
                f = self.space.features(dag, r.schedule)
                if f is not None:
                    feats.append(f)
                    lats.append(best_run_s(r))
                    groups.append(key)
        if feats:
            self.model.update(feats, lats, groups)
        return len(feats)

    def scores(self, pop: list[list[Step]]) -> list[float]:
        """Model scores (higher = predicted faster). Until this task has measurements of its own,
        the prior's alone: trees fitted only on other tasks' records chose W2's first batch worse
        than the prior, and differently with every source run (docs/search.md, "Transfer")."""
        feats = [self.features(s) for s in pop]
        if self.own_samples == 0:
            return list(self.model.prior_scores(feats))
        return list(self.model.predict(feats))

    def update(self, schedules: Sequence[list[Step]], records: Sequence[TuningRecord]) -> None:
        """Remember measurements, keep the best schedules, retrain the cost model on all data."""
        feats, lats = [], []
        for s, r in zip(schedules, records):
            lat = best_run_s(r)
            self.measured[schedule_key(s)] = lat
            g = structure(s)
            self.sketch_best[g] = min(self.sketch_best.get(g, math.inf), lat)
            t = tiling(s)
            self.tiling_count[t] = self.tiling_count.get(t, 0) + 1
            if r.ok:
                self.best.append((lat, s))
                try:
                    feats.append(self.features(s))
                    lats.append(lat)
                except Exception:
                    continue
        self.best.sort(key=lambda x: x[0])
        del self.best[self.elite * 16:]
        if feats:
            self.model.update(feats, lats, [self.task.workload_key] * len(feats))

    # ---- evolution ----
    def _select(self, pop: list[list[Step]], scores: list[float]) -> list[Step]:
        """Fitness-proportional choice (softmax of standardised scores)."""
        mu = sum(scores) / len(scores)
        sd = math.sqrt(sum((x - mu) ** 2 for x in scores) / len(scores)) or 1.0
        w = [math.exp(min(30.0, (x - mu) / sd)) for x in scores]
        return self.rng.choices(pop, weights=w, k=1)[0]

    def elites(self) -> list[list[Step]]:
        """The best measured schedule of each tiling, taken round-robin over sketches (best first
        in each), so one sketch's near-copies cannot crowd out the others' best."""
        groups: dict[tuple, list[list[Step]]] = {}
        seen: set[tuple] = set()
        for _, s in self.best:  # best first: one schedule per tiling
            if tiling(s) not in seen:
                seen.add(tiling(s))
                groups.setdefault(structure(s), []).append(s)
        out: list[list[Step]] = []
        for rank in range(max((len(g) for g in groups.values()), default=0)):
            out += [g[rank] for g in groups.values() if rank < len(g)]
        return out[:self.elite]

    def evolve(self) -> list[tuple[float, list[Step]]]:
        """Candidates seen during evolution with their scores, best first, unmeasured only."""
        dag = self.task.dag
        pop = self.elites()
        pop += self.space.sample(self.sketches, dag, self.population - len(pop), self.rng)
        seen: dict[str, tuple[float, list[Step]]] = {}
        for _ in range(self.generations + 1):
            sc = self.scores(pop)
            for s, x in zip(pop, sc):
                k = schedule_key(s)
                if k not in self.measured:
                    seen[k] = (x, s)
            nxt: list[list[Step]] = []
            for _ in range(len(pop) * 2):
                if len(nxt) >= self.population:
                    break
                if self.rng.random() < self.mutation_prob:
                    child = mutate(dag, self._select(pop, sc), self.rng)
                else:
                    child = crossover(dag, self._select(pop, sc), self._select(pop, sc), self.rng)
                if child is not None and self.valid(child):
                    nxt.append(child)
            pop = nxt or pop
        return sorted(seen.values(), key=lambda x: -x[0])

    def sketch_quota(self, ranked: list[tuple[float, list[Step]]], n: int) -> dict[tuple, int]:
        """How many of `n` model-ranked slots each sketch gets: in proportion to best measured
        latency overall / the sketch's best (1 for a sketch not measured yet), largest remainders
        first. The model ranks well within a sketch and badly across sketches it has seen
        little of, so no sketch is dropped on its first few unlucky samples."""
        best = self.sketch_best
        top = min(best.values(), default=math.inf)
        groups = list(dict.fromkeys(structure(st) for _, st in ranked))
        w = {g: (top / best[g] if g in best and math.isfinite(top) else 1.0) for g in groups}
        total = sum(w.values()) or 1.0
        exact = {g: n * w[g] / total for g in groups}
        quota = {g: int(exact[g]) for g in groups}
        for g in sorted(groups, key=lambda g: quota[g] - exact[g])[:n - sum(quota.values())]:
            quota[g] += 1
        return quota

    def screened(self, pool: int) -> list[tuple[float, list[Step]]]:
        """`pool` new random schedules (unmeasured) with their model scores, best first."""
        cands = [s for s in self.space.sample(self.sketches, self.task.dag, pool, self.rng)
                 if schedule_key(s) not in self.measured]
        return sorted(zip(self.scores(cands), cands), key=lambda x: -x[0]) if cands else []

    def next_batch(self, n: int) -> list[list[Step]]:
        """A batch of three parts. Exploitation: the best predicted unmeasured schedules of the
        evolution, spread over sketches by `sketch_quota` (a sketch with too few candidates
        leaves its slots to the best predicted of the rest). Screened exploration
        (`screen_share` of n): the model's best of `screen_pool` new random schedules, so
        exploration follows the random sampler and the model, not the sampler alone. Random (`eps_greedy`
        of n). The model's picks take one schedule per tiling and skip tilings measured
        TILING_REPEATS times while others are left: otherwise a batch fills with unroll and
        parallel variants of the current best tiling, which the model scores alike."""
        # a model that is neither trained nor ranking by a prior scores all alike: measure random ones
        cold = not getattr(self.model, "informed", True)
        ranked: list[tuple[float, list[Step]]] = [] if cold else self.evolve()
        n_random = max(1, int(round(n * self.eps_greedy))) if ranked else n
        n_screen = min(n - n_random, int(round(n * self.screen_share))) if ranked else 0
        out, keys = [], set()
        tilings: set[tuple] = set()

        def take(s: list[Step], cap: int) -> bool:
            k = schedule_key(s)
            if k in keys or len(out) >= cap:
                return False
            keys.add(k)
            out.append(s)
            return True

        def take_fresh(s: list[Step], cap: int) -> bool:
            t = tiling(s)
            if t in tilings or self.tiling_count.get(t, 0) >= TILING_REPEATS or not take(s, cap):
                return False
            tilings.add(t)
            return True

        n_evolved = n - n_random - n_screen
        quota = self.sketch_quota(ranked, n_evolved) if ranked else {}
        for _, s in ranked:
            g = structure(s)
            if quota.get(g, 0) > 0 and take_fresh(s, n_evolved):
                quota[g] -= 1
        pool = self.screened(self.screen_pool) if n_screen else []
        for cands, cap in ((ranked, n_evolved), (pool, n - n_random)):
            for _, s in cands:  # one schedule per fresh tiling first, then the best of the rest
                take_fresh(s, cap)
            for _, s in cands:
                take(s, cap)
        for _ in range(4):
            for s in self.space.sample(self.sketches, self.task.dag, n - len(out), self.rng):
                k = schedule_key(s)
                if k not in keys and k not in self.measured and len(out) < n:
                    keys.add(k)
                    out.append(s)
            if len(out) >= n:
                break
        for s in out:
            self.measured.setdefault(schedule_key(s), math.inf)
        return out
