"""Alpa's inter-operator stage DP over (layers, devices) with an enumerated bound on the
slowest stage.

For every candidate bound t_max (the distinct stage times, ascending):
    F(s, k, d) = min over i >= k, submesh m of  c(k..i, m, s) + F(s-1, i+1, d - |m|)
where c is the stage's per-micro-batch time (+ its once-per-step time), infinite when it
exceeds t_max or its memory (with the micro-batches in flight for a stage followed by
s-1 others) exceeds the limit; F(0, L, 0) = 0. Latency = F(s, 0, N) + (B - 1) t_max.
Enumeration stops once B * t_max reaches the best latency (no later bound can win), and
with an imbalance tolerance eps a bound is only tried when it exceeds the last tried one
by more than a factor (1 + eps) (Alpa's pruning; eps = 0 is exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class StageChoice:
    """One stage of a DP solution: layers [start, end) on submesh index `submesh`."""

    start: int
    end: int
    submesh: int


@dataclass(frozen=True)
class StageDPResult:
    """Best pipeline found: its stages, latency, slowest-stage bound, and search effort."""

    stages: tuple[StageChoice, ...]
    latency_s: float
    t_max_s: float
    bounds_tried: int


def stage_dp(time_s: np.ndarray, submesh_sizes: Sequence[int], num_devices: int,
             num_micro_batches: int, *, iteration_s: np.ndarray | None = None,
             memory_bytes: np.ndarray | None = None, memory_limit_bytes: float = np.inf,
             num_stages: int | None = None, imbalance_tolerance: float = 0.0) -> StageDPResult:
    """Solve the stage DP.

    time_s[i, j, m, s-1]: per-micro-batch time of layers i..j (inclusive) on submesh m
    when s stages (this one included) run from layer i to the end; same indexing for
    `iteration_s` (added once per step) and `memory_bytes`. Infinite time = impossible.
    Every device is used (sum of submesh sizes = num_devices), as in Alpa.
    """
    time_s = np.asarray(time_s, dtype=np.float64)
    L, L2, M, S = time_s.shape
    if L != L2 or M != len(submesh_sizes):
        raise ValueError(f"time_s must be [L, L, M, S]; got {time_s.shape} for {len(submesh_sizes)} submeshes")
    B = num_micro_batches
    extra = np.zeros_like(time_s) if iteration_s is None else np.asarray(iteration_s, np.float64)
    ok = np.isfinite(time_s)
    if memory_bytes is not None:
        ok &= np.asarray(memory_bytes) <= memory_limit_bytes
    ok &= np.triu(np.ones((L, L), bool))[:, :, None, None]
    stage_range = range(1, S + 1) if num_stages is None else [num_stages]
    if num_stages is not None and not 1 <= num_stages <= S:
        raise ValueError(f"num_stages={num_stages} but costs are given for 1..{S} stages")
    sizes = np.asarray(submesh_sizes, dtype=np.int64)
    N = num_devices
    candidates = np.unique(time_s[ok])
    best: tuple[float, float, list] | None = None
    tried = 0
    k = 0
    while k < len(candidates):
        # a window of bounds within (1 + eps) of its smallest: evaluate only its largest
        lo = candidates[k]
        k = int(np.searchsorted(candidates, lo * (1.0 + imbalance_tolerance), side="right"))
        t_max = candidates[k - 1]
        if best is not None and B * lo >= best[0]:
            break
        tried += 1
        cost = np.where(ok & (time_s <= t_max), time_s + extra, np.inf)
        F = np.full((L + 1, N + 1), np.inf)
        F[L, 0] = 0.0
        choices = []
        for s in range(1, max(stage_range) + 1):
            newF = np.full((L + 1, N + 1), np.inf)
            arg = np.zeros((L, N + 1, 2), dtype=np.int64)
            for m, size in enumerate(sizes):
                if size > N:
                    continue
                G = np.full((L, N + 1), np.inf)      # G[i, d] = F[i+1, d - size]
                G[:, size:] = F[1:, :N + 1 - size]
                cand = cost[:, :, m, s - 1][:, :, None] + G[None, :, :]   # [k, i, d]
                i_best = np.argmin(cand, axis=1)
                v = np.take_along_axis(cand, i_best[:, None, :], axis=1)[:, 0, :]
                better = v < newF[:L]
                newF[:L] = np.where(better, v, newF[:L])
                arg[..., 0] = np.where(better, i_best, arg[..., 0])
                arg[..., 1] = np.where(better, m, arg[..., 1])
            choices.append(arg)
            F = newF
            if s in stage_range and np.isfinite(F[0, N]):
                stages = _reconstruct(choices, s, L, N, sizes)
                times = [time_s[c.start, c.end - 1, c.submesh, s - 1 - n] for n, c in enumerate(stages)]
                latency = F[0, N] + (B - 1) * max(times)
                if best is None or latency < best[0] * (1 - 1e-12):
                    best = (latency, max(times), stages)
    if best is None:
        raise ValueError("no pipeline fits: every stage choice exceeds the memory limit or "
                         "cannot use all devices; add devices, lower the batch size, or "
                         "allow more stages")
    return StageDPResult(tuple(best[2]), float(best[0]), float(best[1]), tried)


def _reconstruct(choices, s, L, N, sizes) -> list[StageChoice]:
    out, k, d = [], 0, N
    for level in range(s, 0, -1):
        i, m = choices[level - 1][k, d]
        out.append(StageChoice(int(k), int(i) + 1, int(m)))
        k, d = int(i) + 1, d - int(sizes[m])
    assert k == L and d == 0
    return out
