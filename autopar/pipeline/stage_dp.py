"""Alpa's inter-operator stage DP over (layers, devices) with an enumerated bound on the
slowest stage.

For every candidate bound t_max (the distinct stage times, ascending):
    F(s, k, d) = min over i >= k, submesh m, option o of  c(k..i, m, s, o) + F(s-1, i+1, d - |m|)
where c is the stage's per-micro-batch time plus its once-per-step time, infinite when the
per-micro-batch time exceeds t_max or the memory (with the micro-batches in flight for a
stage followed by s-1 others) exceeds the limit; F(0, L, 0) = 0. The options o are the
intra-stage choices (logical mesh shapes): within one bound the best option is the one
with the least c, so the DP stays exact over them. Latency = F(s, 0, N) + (B - 1) * max.

Pruning: bounds below the smallest feasible one are skipped (that one is the least slowest
stage of any pipeline, from one bottleneck DP: `_least_feasible_bound`); enumeration stops
once the least stage-time sum under no bound plus (B - 1) * t_max reaches the best latency
(a solution first found under t_max has its slowest stage at t_max). With an
imbalance tolerance eps (Alpa's pruning) the bounds are grouped into windows
[t, (1 + eps) t] and only each window's largest bound is tried, so the result is within a
factor (1 + eps) of the optimum; eps = 0 is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from autopar.pipeline.best_first import Refinement


@dataclass(frozen=True)
class StageChoice:
    """One stage of a DP solution: layers [start, end) on submesh `submesh`, option `option`."""

    start: int
    end: int
    submesh: int
    option: int = 0


@dataclass(frozen=True)
class StageDPResult:
    """Best pipeline found: its stages, latency, slowest stage, and search effort."""

    stages: tuple[StageChoice, ...]
    latency_s: float
    t_max_s: float
    bounds_tried: int


def stage_dp(time_s: np.ndarray, submesh_sizes: Sequence[int], num_devices: int,
             num_micro_batches: int, *, iteration_s: np.ndarray | None = None,
             memory_bytes: np.ndarray | None = None, memory_limit_bytes: float = np.inf,
             num_stages: int | None = None, imbalance_tolerance: float = 0.0) -> StageDPResult:
    """Solve the stage DP.

    time_s[i, j, m, s-1(, o)]: per-micro-batch time of layers i..j (inclusive) on submesh
    m (with intra-stage option o) when s stages, this one included, run from layer i to
    the end; same indexing for `iteration_s` (added once per step) and `memory_bytes`.
    Infinite time = impossible. Every device is used (sizes sum to num_devices), as in Alpa.
    """
    time_s = np.asarray(time_s, dtype=np.float64)
    if time_s.ndim == 4:
        time_s = time_s[..., None]
        iteration_s = None if iteration_s is None else np.asarray(iteration_s)[..., None]
        memory_bytes = None if memory_bytes is None else np.asarray(memory_bytes)[..., None]
    if time_s.ndim != 5:
        raise ValueError(f"time_s must be [L, L, M, S] or [L, L, M, S, options]; got {time_s.shape}")
    L, L2, M, S, K = time_s.shape
    if L != L2 or M != len(submesh_sizes):
        raise ValueError(f"time_s must be [L, L, M, S(, K)]; got {time_s.shape} for "
                         f"{len(submesh_sizes)} submeshes")
    if num_stages is not None and not 1 <= num_stages <= S:
        raise ValueError(f"num_stages={num_stages} but costs are given for 1..{S} stages")
    B, N = num_micro_batches, num_devices
    total = time_s + (0.0 if iteration_s is None else np.asarray(iteration_s, np.float64))
    ok = np.isfinite(time_s)
    if memory_bytes is not None:
        ok &= np.asarray(memory_bytes) <= memory_limit_bytes
    ok &= np.triu(np.ones((L, L), bool))[:, :, None, None, None]
    time_ok = np.where(ok, time_s, np.inf)
    total_ok = np.where(ok, total, np.inf)
    time_ok, total_ok, option_of = _pareto_options(time_ok, total_ok)
    stage_counts = list(range(1, S + 1)) if num_stages is None else [num_stages]
    sizes = np.asarray(submesh_sizes, dtype=np.int64)

    n_options = np.count_nonzero(np.isfinite(time_ok), axis=4)

    def solve(t_max: float):
        """Best solution per stage count under the bound: {s: (sum, stages)}."""
        # the Pareto options run from fastest to least total: the best within the bound is
        # the last one within it
        within = np.minimum(np.count_nonzero(time_ok <= t_max, axis=4), n_options)
        pick = np.maximum(within - 1, 0)[..., None]
        cost = np.where(within > 0, np.take_along_axis(total_ok, pick, axis=4)[..., 0], np.inf)   # [L, L, M, S]
        option = np.take_along_axis(option_of, pick, axis=4)[..., 0]
        F = np.full((L + 1, N + 1), np.inf)
        F[L, 0] = 0.0
        # G[m, i, d] = F[i + 1, d - size_m]
        shift = np.full((M, L, N + 1), np.inf)
        args, found = [], {}
        for s in range(1, max(stage_counts) + 1):
            shift[:] = np.inf
            for m, size in enumerate(sizes):
                if size <= N:
                    shift[m, :, size:] = F[1:, :N + 1 - size]
            cand = cost[:, :, :, s - 1].transpose(0, 2, 1)[:, :, :, None] + shift[None]  # [k, m, i, d]
            flat = cand.reshape(L, M * L, N + 1)
            best = np.argmin(flat, axis=1)                                              # [k, d]
            F = np.full((L + 1, N + 1), np.inf)
            F[:L] = np.take_along_axis(flat, best[:, None, :], axis=1)[:, 0, :]
            args.append(best)
            if s in stage_counts and np.isfinite(F[0, N]):
                found[s] = (F[0, N], _reconstruct(args, option, s, L, N, sizes))
        return found

    candidates = np.unique(time_ok[np.isfinite(time_ok)])
    lo_i = int(np.searchsorted(candidates, _least_feasible_bound(time_ok[..., 0], sizes, N, stage_counts)))
    best: tuple[float, float, list] | None = None
    tried = 0
    k = lo_i
    # a solution first found under bound t has its slowest stage at t, so its latency is at
    # least the least stage-time sum under no bound plus (B - 1) t
    unbounded = solve(np.inf) if lo_i < len(candidates) else {}
    least_sum = min((v[0] for v in unbounded.values()), default=0.0)
    while k < len(candidates):
        lo = candidates[k]
        if best is not None and least_sum + (B - 1) * lo >= best[0]:
            break
        k = int(np.searchsorted(candidates, lo * (1.0 + imbalance_tolerance), side="right"))
        tried += 1
        for s, (_, stages) in solve(candidates[k - 1]).items():
            times = [time_s[c.start, c.end - 1, c.submesh, s - 1 - n, c.option] for n, c in enumerate(stages)]
            sums = [total[c.start, c.end - 1, c.submesh, s - 1 - n, c.option] for n, c in enumerate(stages)]
            latency = float(sum(sums) + (B - 1) * max(times))
            if best is None or latency < best[0] * (1 - 1e-12):
                best = (latency, float(max(times)), stages)
    if best is None:
        raise ValueError("no pipeline fits: every stage choice exceeds the memory limit or "
                         "cannot use all devices; add devices, lower the batch size, or "
                         "allow more stages")
    return StageDPResult(tuple(best[2]), best[0], best[1], tried)


def _least_feasible_bound(fastest: np.ndarray, sizes: np.ndarray, N: int, stage_counts: Sequence[int]) -> float:
    """The least t_max under which some pipeline exists: the DP's recursion with (min, max)
    in place of (min, +), H(s, k, d) = min over i, m of max(fastest[k, i, m, s], H(s-1,
    i+1, d - |m|)), fastest being each candidate's least feasible per-micro-batch time."""
    L, _, M, _ = fastest.shape
    H = np.full((L + 1, N + 1), np.inf)
    H[L, 0] = 0.0
    shift = np.full((M, L, N + 1), np.inf)
    least = np.inf
    for s in range(1, max(stage_counts) + 1):
        shift[:] = np.inf
        for m, size in enumerate(sizes):
            if size <= N:
                shift[m, :, size:] = H[1:, :N + 1 - size]
        cand = np.maximum(fastest[:, :, :, s - 1].transpose(0, 2, 1)[:, :, :, None], shift[None])   # [k, m, i, d]
        H = np.full((L + 1, N + 1), np.inf)
        H[:L] = cand.reshape(L, M * L, N + 1).min(axis=1)
        if s in stage_counts:
            least = min(least, H[0, N])
    return float(least)


def _pareto_options(time_ok: np.ndarray, total_ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep, per (range, submesh, stage count), only the options no other option beats on
    both per-micro-batch time and total: under any bound the least total among the options
    within it is one of these. Returns (time, total, original option index) over the kept
    options, padded with infinite times; the DP's work shrinks with the option count."""
    order = np.argsort(time_ok, axis=4, kind="stable")
    t = np.take_along_axis(time_ok, order, axis=4)
    tot = np.take_along_axis(total_ok, order, axis=4)
    before = np.minimum.accumulate(tot, axis=4)
    before = np.concatenate([np.full(tot.shape[:4] + (1,), np.inf), before[..., :-1]], axis=4)
    keep = np.isfinite(t) & (tot < before)
    width = max(int(keep.sum(axis=4).max(initial=0)), 1)
    slot = np.where(keep, np.cumsum(keep, axis=4) - 1, width)      # kept options move to the front
    shape = tot.shape[:4] + (width + 1,)
    out_t, out_tot = np.full(shape, np.inf), np.full(shape, np.inf)
    out_o = np.zeros(shape, dtype=np.int64)
    for out, values in ((out_t, t), (out_tot, tot), (out_o, order)):
        np.put_along_axis(out, slot, values, axis=4)     # dropped options all land in the last slot
    return out_t[..., :width], out_tot[..., :width], out_o[..., :width]


def _reconstruct(args, option, s, L, N, sizes) -> list[StageChoice]:
    out, k, d = [], 0, N
    for level in range(s, 0, -1):
        flat = int(args[level - 1][k, d])
        m, i = divmod(flat, L)
        out.append(StageChoice(k, i + 1, m, int(option[k, i, m, level - 1])))
        k, d = i + 1, d - int(sizes[m])
    assert k == L and d == 0
    return out


def lazy_stage_dp(tensors: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]],
                  is_exact: Callable[[StageChoice, int], bool], price: Callable[[StageChoice, int], None],
                  submesh_sizes: Sequence[int], num_devices: int, num_micro_batches: int, *,
                  priced: Callable[[], np.ndarray] | None = None, tolerance: float = 0.0,
                  **kwargs) -> StageDPResult:
    """The stage DP over candidates priced on demand. `tensors()` gives the current (time,
    once-per-step time, memory); a candidate not yet priced holds a lower bound of its time
    and memory. Solve, price the candidates the solution uses (`price(stage, stages from
    it)`), repeat until the solution uses only priced candidates: then it is optimal,
    since every other candidate costs at least its bound.

    With `tolerance` > 0 and `priced()` (a mask of the priced candidates), stop as soon as
    the best pipeline of priced candidates is within that fraction of the bound: the
    result is then within (1 + tolerance) of the optimum, for far fewer prices."""
    for r in lazy_stage_dp_steps(tensors, is_exact, price, submesh_sizes, num_devices, num_micro_batches,
                                 priced=priced if tolerance > 0 else None, **kwargs):
        if r.done or r.upper_s <= r.lower_s * (1 + tolerance):
            return r.result
    raise AssertionError("the lazy stage DP ends with a solution")


def lazy_stage_dp_steps(tensors: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]],
                        is_exact: Callable[[StageChoice, int], bool], price: Callable[[StageChoice, int], None],
                        submesh_sizes: Sequence[int], num_devices: int, num_micro_batches: int, *,
                        priced: Callable[[], np.ndarray] | None = None, **kwargs) -> Iterator[Refinement]:
    """`lazy_stage_dp` one solve at a time, for a best-first search over several such
    problems (`best_first`): each step yields the DP's latency on the current tensors (a
    lower bound of the optimum), with `priced()` the best pipeline of priced candidates
    (an upper bound), and prices what the solution uses when resumed. Raises ValueError
    when nothing fits."""
    while True:
        time_s, it, mem = tensors()
        res = stage_dp(time_s, submesh_sizes, num_devices, num_micro_batches, iteration_s=it,
                       memory_bytes=mem, **kwargs)
        S = len(res.stages)
        pending = [(st, S - n) for n, st in enumerate(res.stages) if not is_exact(st, S - n)]
        if not pending:
            yield Refinement(lower_s=res.latency_s, upper_s=res.latency_s, result=res, done=True)
            return
        best = None
        if priced is not None:
            try:
                best = stage_dp(np.where(priced(), time_s, np.inf), submesh_sizes, num_devices, num_micro_batches,
                                iteration_s=it, memory_bytes=mem, **kwargs)
            except ValueError:
                pass
        yield Refinement(lower_s=res.latency_s, upper_s=best.latency_s if best else np.inf, result=best)
        for st, s in pending:
            price(st, s)
