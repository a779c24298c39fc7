"""TeraPipe's dynamic programs (Li et al., ICML'21): how to cut each sequence into token
slices, and the batch into micro-batches, for a pipeline of causal-LM stages.

Work items (a micro-batch's slice) flow through the pipeline one after another. With
t(w) the time of item w on the slowest stage, the step takes

    latency = sum_w t(w) + depth * max_w t(w)

(depth = stages - 1 for equal stages: TeraPipe's formula; `item_depth` gives it for
unequal ones). For a bound t_max on the largest item the best slicing of one micro-batch
of size b is a shortest path over token positions:

    f(0) = 0,   f(i) = min over l: t_b(l, i - l) <= t_max of  f(i - l) + t_b(l, i - l)

where t_b(l, c) is a slice of l tokens after c tokens of context. The batch is then split
into micro-batch sizes: G(0) = 0, G(n) = min over b of G(n - b) + f_b(L) (the two-level
DP). Bounds are enumerated over the distinct item times in increasing order, with
TeraPipe's early exit once depth * t_max reaches the best latency found: a solution
first found under t_max has its largest item at t_max. All bounds of a chunk are solved
at once (numpy over the bound axis).

Lengths are in units of `granularity` tokens; a cost table is indexed [l - 1, c] in units
(inf where l + c exceeds the sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class TokenSchedule:
    """A batch split into micro-batches and each micro-batch's token slices (in tokens)."""

    micro_batch_sizes: tuple[int, ...]
    slices: tuple[tuple[int, ...], ...]         # per micro-batch, lengths summing to the sequence
    latency_s: float
    t_max_s: float
    bounds_tried: int = 0

    @property
    def num_items(self) -> int:
        return sum(len(s) for s in self.slices)


def cost_table(time_s: Callable[[np.ndarray, np.ndarray], np.ndarray], seq_len: int,
               granularity: int = 1) -> np.ndarray:
    """[l - 1, c] in units of `granularity` tokens: time_s(l tokens, c tokens of context),
    evaluated on arrays of lengths and contexts at once."""
    if granularity < 1 or seq_len % granularity:
        raise ValueError(f"granularity {granularity} must divide the sequence length {seq_len}")
    n = seq_len // granularity
    l, c = np.meshgrid(np.arange(1, n + 1), np.arange(n), indexing="ij")
    table = np.broadcast_to(np.asarray(time_s(l * granularity, c * granularity), np.float64), (n, n))
    return np.where(l + c <= n, table, np.inf)


def granularity_for(seq_len: int, max_units: int) -> int:
    """The smallest divisor of seq_len that cuts it into at most `max_units` units."""
    return next(g for g in range(1, seq_len + 1) if seq_len % g == 0 and seq_len // g <= max_units)


def latency_s(item_s: Sequence[float], depth: float) -> float:
    """TeraPipe's pipeline latency of items run back to back."""
    return float(sum(item_s) + depth * max(item_s))


def item_depth(stage_s: Sequence[float]) -> float:
    """`depth` for stages of unequal time: (sum - max) / max of one item's stage times, so
    that sum_w t(w) + depth * max_w t(w) with t the slowest stage's time is Alpa's latency
    sum(stage) + (B - 1) * max(stage) when all items are equal, and TeraPipe's when all
    stages are."""
    top = max(stage_s)
    return float((sum(stage_s) - top) / top) if top > 0 else 0.0


def slice_times(table: np.ndarray, lengths_units: Sequence[int]) -> list[float]:
    """Times of consecutive slices of the given lengths (units)."""
    out, c = [], 0
    for l in lengths_units:
        out.append(float(table[l - 1, c]))
        c += l
    return out


def _best_sums(table: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each bound: the least sum of slice times covering the sequence with every slice
    at most the bound (inf if none), and the DP's choice of last slice per position."""
    n = table.shape[0]
    f = np.full((len(bounds), n + 1), np.inf)
    f[:, 0] = 0.0
    choice = np.zeros((len(bounds), n + 1), np.int64)
    for i in range(1, n + 1):
        k = np.arange(i)                          # slice length - 1
        t = table[k, i - 1 - k]                   # slice ending at i, context i - 1 - k
        cand = f[:, i - 1 - k] + np.where(t[None, :] <= bounds[:, None], t[None, :], np.inf)
        j = np.argmin(cand, axis=1)
        f[:, i] = cand[np.arange(len(bounds)), j]
        choice[:, i] = j + 1
    return f[:, n], choice


def _lengths(choice: np.ndarray) -> tuple[int, ...]:
    out, i = [], len(choice) - 1
    while i > 0:
        out.append(int(choice[i]))
        i -= int(choice[i])
    return tuple(reversed(out))


def token_dp(tables: Mapping[int, np.ndarray], batch_size: int, depth: float, *, granularity: int = 1,
             chunk: int = 256) -> TokenSchedule:
    """The best split of `batch_size` sequences into micro-batches of the sizes in `tables`
    (size -> cost table) and of each micro-batch into slices. One size in `tables` that
    divides the batch fixes the split; one table of size `batch_size` is one micro-batch."""
    sizes = sorted(tables)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"need cost tables for micro-batch sizes >= 1, got {sizes}")
    n = {tables[b].shape[0] for b in sizes}
    if len(n) != 1:
        raise ValueError(f"cost tables cover different sequence lengths: {sorted(n)} units")
    values = np.unique(np.concatenate([t[np.isfinite(t)] for t in tables.values()]))
    best: tuple[float, float, int] | None = None           # latency, bound, index
    tried = 0
    for start in range(0, len(values), chunk):
        bounds = values[start:start + chunk]
        if best is not None and depth * bounds[0] >= best[0]:
            break
        tried += len(bounds)
        sums = np.stack([_best_sums(tables[b], bounds)[0] for b in sizes])      # [size, bound]
        g = _split_sums(sums, sizes, batch_size)[0]
        total = g + depth * bounds
        j = int(np.argmin(total))
        if np.isfinite(total[j]) and (best is None or total[j] < best[0]):
            best = (float(total[j]), float(bounds[j]), j)
    if best is None:
        raise ValueError(f"no split of a batch of {batch_size} into micro-batches of sizes {sizes} exists")
    bound = np.array([best[1]])
    sums, choices = {}, {}
    for b in sizes:
        s, c = _best_sums(tables[b], bound)
        sums[b], choices[b] = s[0], c[0]
    _, split = _split_sums(np.array([[sums[b]] for b in sizes]), sizes, batch_size)
    parts = split[0]
    slices = tuple(tuple(l * granularity for l in _lengths(choices[b])) for b in parts)
    items = [t for b in parts for t in slice_times(tables[b], _lengths(choices[b]))]
    return TokenSchedule(micro_batch_sizes=tuple(parts), slices=slices, latency_s=latency_s(items, depth),
                         t_max_s=max(items), bounds_tried=tried)


def _split_sums(sums: np.ndarray, sizes: Sequence[int], batch_size: int) -> tuple[np.ndarray, list[list[int]]]:
    """Unbounded knapsack over micro-batch sizes per bound: G[n] = min_b G[n - b] + sums[b];
    returns G[batch_size] per bound and, for a single bound, the sizes chosen."""
    G = np.full((batch_size + 1, sums.shape[1]), np.inf)
    G[0] = 0.0
    pick = np.full((batch_size + 1, sums.shape[1]), -1)
    for m in range(1, batch_size + 1):
        for k, b in enumerate(sizes):
            if b <= m:
                cand = G[m - b] + sums[k]
                better = cand < G[m]
                G[m] = np.where(better, cand, G[m])
                pick[m] = np.where(better, k, pick[m])
    splits = []
    if sums.shape[1] == 1 and np.isfinite(G[batch_size, 0]):
        m, parts = batch_size, []
        while m > 0:
            b = sizes[int(pick[m, 0])]
            parts.append(b)
            m -= b
        splits.append(sorted(parts, reverse=True))
    return G[batch_size], splits


def slicing_dp(table: np.ndarray, depth: float, *, granularity: int = 1) -> TokenSchedule:
    """The best slicing of one micro-batch (TeraPipe's DP with a fixed batch split)."""
    return token_dp({1: table}, 1, depth, granularity=granularity)


def uniform_lengths(seq_len: int, num_slices: int, granularity: int = 1) -> tuple[int, ...]:
    """`num_slices` lengths, multiples of `granularity`, as equal as possible, summing to seq_len."""
    n = seq_len // granularity
    if num_slices < 1 or num_slices > n or seq_len % granularity:
        raise ValueError(f"cannot cut {seq_len} tokens into {num_slices} slices of whole "
                         f"units of {granularity} tokens")
    q, r = divmod(n, num_slices)
    return tuple((q + (1 if i < r else 0)) * granularity for i in range(num_slices))


def fixed_schedule(tables: Mapping[int, np.ndarray], micro_batch_sizes: Sequence[int],
                   lengths: Sequence[int], depth: float, *, granularity: int = 1) -> TokenSchedule:
    """The latency of given micro-batch sizes with the same given slicing (tokens) each."""
    units = [l // granularity for l in lengths]
    items = [t for b in micro_batch_sizes for t in slice_times(tables[b], units)]
    return TokenSchedule(micro_batch_sizes=tuple(micro_batch_sizes),
                         slices=tuple(tuple(lengths) for _ in micro_batch_sizes),
                         latency_s=latency_s(items, depth), t_max_s=max(items))
