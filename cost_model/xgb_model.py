"""Learned cost model: XGBoost with a pairwise ranking objective over program feature vectors.
Labels are normalised throughputs (best latency of the group / latency), groups are tasks;
the model is refitted on all data seen so far after every batch of measurements.

Scores start from a prior: `prior_weight` x -log2 of the program's analytic time estimate,
given to XGBoost as the base margin, so the trees learn where the estimate is wrong and the
estimate ranks what they have no data for (including everything before the first batch)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Sequence

import numpy as np

from .features import Statement, backend_of, feature_matrix, prior_margin


class XGBoostCostModel:
    """Predicts a score per program (higher = faster) for programs of the same task."""

    def __init__(self, n_rounds: int = 60, max_depth: int = 6, learning_rate: float = 0.2, seed: int = 0,
                 prior_weight: float = 1.0):
        self.params = {"objective": "rank:pairwise", "max_depth": max_depth, "eta": learning_rate,
                       "min_child_weight": 1, "subsample": 0.9, "colsample_bytree": 0.9, "seed": seed,
                       "nthread": 1, "verbosity": 0}
        self.n_rounds = n_rounds
        self.prior_weight = prior_weight
        self.booster = None
        self._x: list[np.ndarray] = []
        self._margin: list[float] = []
        self._lat: list[float] = []
        self._group: list[str] = []
        self.backend: str | None = None  # the backend of the programs trained on ("c", "pallas")

    def _check_backend(self, programs: Sequence[Sequence[Statement]]) -> None:
        """One model per backend: its features and latencies are not comparable across them."""
        if not programs:
            return
        backend = backend_of(programs)
        if self.backend is not None and backend != self.backend:
            raise ValueError(f"this cost model is trained on {self.backend} programs and was given "
                             f"{backend} programs; use one model per backend")

    @property
    def n_samples(self) -> int:
        return len(self._lat)

    def n_samples_of(self, group: str) -> int:
        """How many of the training records belong to `group` (a task's workload key)."""
        return self._group.count(group)

    @property
    def informed(self) -> bool:
        """Whether scores mean anything yet: trained, or ranking by the prior."""
        return self.booster is not None or self.prior_weight > 0

    def update(self, programs: Sequence[Sequence[Statement]], latencies_s: Sequence[float],
               groups: Sequence[str]) -> None:
        """Add measured programs (finite latencies only) and refit on everything seen so far."""
        if not (len(programs) == len(latencies_s) == len(groups)):
            raise ValueError("update: programs, latencies_s and groups must have the same length")
        self._check_backend(programs)
        if programs:
            self.backend = backend_of(programs)
        x, margin = feature_matrix(programs), prior_margin(programs)
        for row, mg, lat, g in zip(x, margin, latencies_s, groups):
            if np.isfinite(lat) and lat > 0:
                self._x.append(row)
                self._margin.append(float(mg))
                self._lat.append(float(lat))
                self._group.append(g)
        self._fit()

    def _fit(self) -> None:
        import xgboost as xgb

        if len(self._lat) < 4:
            return
        order = np.argsort(np.array(self._group), kind="stable")
        x = np.stack(self._x)[order]
        margin = np.array(self._margin, dtype=np.float32)[order] * self.prior_weight
        lat = np.array(self._lat)[order]
        groups = np.array(self._group)[order]
        labels = np.empty_like(lat)
        sizes = []
        for g in dict.fromkeys(groups):
            m = groups == g
            labels[m] = lat[m].min() / lat[m]
            sizes.append(int(m.sum()))
        d = xgb.DMatrix(x, label=labels, base_margin=margin)
        d.set_group(sizes)
        self.booster = xgb.train(self.params, d, num_boost_round=self.n_rounds)

    def prior_scores(self, programs: Sequence[Sequence[Statement]]) -> np.ndarray:
        """The prior's scores alone, without the trees."""
        return (prior_margin(programs) * self.prior_weight).astype(np.float64)

    def predict(self, programs: Sequence[Sequence[Statement]]) -> np.ndarray:
        """Scores (higher = predicted faster): the prior alone before the model has data (all
        zeros without a prior)."""
        self._check_backend(programs)
        margin = self.prior_scores(programs)
        if self.booster is None or not programs:
            return margin
        import xgboost as xgb

        return self.booster.predict(xgb.DMatrix(feature_matrix(programs), base_margin=margin))

    def save(self, path: str) -> None:
        """Write model and training data atomically (a failed save never clobbers a good file)."""
        import xgboost as xgb  # noqa: F401

        state = {"params": self.params, "n_rounds": self.n_rounds, "prior_weight": self.prior_weight,
                 "backend": self.backend,
                 "margins": self._margin, "x": [r.tolist() for r in self._x],
                 "latencies_s": self._lat, "groups": self._group,
                 "booster": bytearray(self.booster.save_raw("json")).decode() if self.booster else None}
        d = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    @staticmethod
    def load(path: str) -> "XGBoostCostModel":
        import xgboost as xgb

        with open(path) as f:
            try:
                state = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not a saved XGBoostCostModel: {e}") from None
        m = XGBoostCostModel()
        m.params, m.n_rounds = state["params"], state["n_rounds"]
        m._x = [np.array(r, dtype=np.float32) for r in state["x"]]
        m._lat, m._group = list(state["latencies_s"]), list(state["groups"])
        m.backend = state.get("backend", "c" if m._lat else None)  # files from before backends: C
        # files saved before the prior existed: no margins, and the trees were fitted without one
        m.prior_weight = float(state.get("prior_weight", 0.0))
        m._margin = [float(v) for v in state.get("margins", [0.0] * len(m._lat))]
        if state["booster"]:
            m.booster = xgb.Booster()
            m.booster.load_model(bytearray(state["booster"].encode()))
        return m


class RandomCostModel:
    """Uniform random scores: the model-free baseline behind the same interface."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def update(self, programs, latencies_s, groups) -> None:
        pass

    def predict(self, programs) -> np.ndarray:
        return self.rng.random(len(programs))


def pairwise_accuracy(scores: Sequence[float], latencies_s: Sequence[float]) -> float:
    """Fraction of pairs with different latencies that the scores order correctly (0.5 = chance)."""
    s, lat = np.asarray(scores, float), np.asarray(latencies_s, float)
    i, j = np.triu_indices(len(s), 1)
    keep = lat[i] != lat[j]
    if not keep.any():
        return 0.5
    i, j = i[keep], j[keep]
    right = np.sign(s[i] - s[j]) == np.sign(lat[j] - lat[i])
    ties = s[i] == s[j]
    return float((right.sum() + 0.5 * ties.sum()) / len(i))
