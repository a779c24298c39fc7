"""Rotor-style dynamic program over a chain of blocks with several options per block.

Memory is in integer units (the caller discretises bytes). Blocks are 0..n-1; slot j holds
the activation between block j-1 and block j (or later its cotangent), size a[j].
Seq(s..t) runs forward+backward of blocks s..t; its budget excludes slots s and t+1,
which its caller holds. Two moves (Beaumont et al., Rotor; Rockmate's option choice):

  Leaf(s, o): forward block s with option o (keeps kept_o), hold slot s+1, run Seq(s+1..t),
              then block s's backward, during which the input's cotangent (a[s]) appears
              while the input itself is still held.
                                    peak = max(fwd_o + a[s+1], bwd_o + a[s+1] + a[s],
                                               kept_o + a[s+1] + peak(rest))
  Split(k):   forward s..k-1 keeping nothing but slot k, run Seq(k..t), then recompute
              and differentiate Seq(s..k-1).  peak = max(fwd transients,
                                                    a[k] + peak(right), a[k] + peak(left))

C(s, t, m) = least time of a schedule whose peak <= m; exact for integer sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np


@dataclass(frozen=True)
class ChainOption:
    """One way to run a block, in memory units and seconds."""

    fwd_time_s: float
    bwd_time_s: float
    kept: int
    fwd_peak: int
    bwd_peak: int


@dataclass(frozen=True)
class ChainBlock:
    """A block of the chain: its options and its non-recording forward."""

    options: tuple[ChainOption, ...]
    nr_time_s: float  # forward without keeping anything
    nr_peak: int  # transient of that forward beyond input and output slots


@dataclass(frozen=True)
class Leaf:
    block: int
    option: int
    rest: "Schedule | None"


@dataclass(frozen=True)
class Split:
    at: int  # first block of the right part
    left: "Schedule"
    right: "Schedule"


Schedule = Union[Leaf, Split]


def schedule_cost(blocks: Sequence[ChainBlock], a: Sequence[int], tree: Schedule,
                  s: int, t: int) -> tuple[float, int]:
    """(time, peak) of running Seq(s..t) with `tree`."""
    if isinstance(tree, Leaf):
        o = blocks[s].options[tree.option]
        if tree.rest is None:
            assert s == t
            return o.fwd_time_s + o.bwd_time_s, max(o.fwd_peak, o.bwd_peak + a[s])
        rt, rp = schedule_cost(blocks, a, tree.rest, s + 1, t)
        x = a[s + 1]
        return (o.fwd_time_s + o.bwd_time_s + rt,
                max(o.fwd_peak + x, o.bwd_peak + x + a[s], o.kept + x + rp))
    k = tree.at
    rt, rp = schedule_cost(blocks, a, tree.right, k, t)
    lt, lp = schedule_cost(blocks, a, tree.left, s, k - 1)
    fwd_t = sum(blocks[j].nr_time_s for j in range(s, k))
    fwd_p = max(blocks[j].nr_peak + (a[j] if j > s else 0) + a[j + 1] for j in range(s, k))
    return fwd_t + rt + lt, max(fwd_p, a[k] + rp, a[k] + lp)


def _shift(arr: np.ndarray, d: int) -> np.ndarray:
    """out[m] = arr[m - d] (inf where m - d < 0)."""
    out = np.full_like(arr, np.inf)
    if d <= 0:
        return arr.copy() if d == 0 else np.concatenate([arr[-d:], np.full(-d, arr[-1])])
    if d < len(arr):
        out[d:] = arr[: len(arr) - d]
    return out


def solve_chain(blocks: Sequence[ChainBlock], a: Sequence[int], budget: int) -> tuple[float, Schedule] | None:
    """Fastest schedule of the whole chain with peak <= budget units; None if none fits."""
    n = len(blocks)
    S = budget + 1
    m = np.arange(S)
    C: dict[tuple[int, int], np.ndarray] = {}
    choice: dict[tuple[int, int], np.ndarray] = {}
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            best = np.full(S, np.inf)
            code = np.full(S, -(10 ** 6), dtype=np.int64)
            for oi, o in enumerate(blocks[s].options):
                if s == t:
                    cand = np.where(m >= max(o.fwd_peak, o.bwd_peak + a[s]), o.fwd_time_s + o.bwd_time_s, np.inf)
                else:
                    x = a[s + 1]
                    inner = _shift(C[(s + 1, t)], o.kept + x)
                    cand = np.where(m >= max(o.fwd_peak, o.bwd_peak + a[s]) + x,
                                    o.fwd_time_s + o.bwd_time_s + inner, np.inf)
                better = cand < best
                best = np.where(better, cand, best)
                code = np.where(better, oi, code)
            fwd_t = 0.0
            fwd_p = 0
            for k in range(s + 1, t + 1):
                j = k - 1
                fwd_t += blocks[j].nr_time_s
                fwd_p = max(fwd_p, blocks[j].nr_peak + (a[j] if j > s else 0) + a[j + 1])
                cand = fwd_t + _shift(C[(k, t)], a[k]) + _shift(C[(s, k - 1)], a[k])
                cand = np.where(m >= fwd_p, cand, np.inf)
                better = cand < best
                best = np.where(better, cand, best)
                code = np.where(better, -k, code)
            C[(s, t)] = best
            choice[(s, t)] = code
    total = C[(0, n - 1)][budget]
    if not np.isfinite(total):
        return None

    def build(s: int, t: int, mm: int) -> Schedule:
        c = int(choice[(s, t)][mm])
        if c >= 0:
            o = blocks[s].options[c]
            if s == t:
                return Leaf(s, c, None)
            return Leaf(s, c, build(s + 1, t, mm - o.kept - a[s + 1]))
        k = -c
        return Split(k, build(s, k - 1, mm - a[k]), build(k, t, mm - a[k]))

    return float(total), build(0, n - 1, budget)


def min_peak(blocks: Sequence[ChainBlock], a: Sequence[int]) -> tuple[int, Schedule]:
    """The smallest peak any schedule of the chain reaches, and a fastest schedule reaching it
    among those this min-max DP compares (exact in the peak)."""
    n = len(blocks)
    P: dict[tuple[int, int], tuple[int, float, Schedule]] = {}
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            best = None
            for oi, o in enumerate(blocks[s].options):
                if s == t:
                    v = (max(o.fwd_peak, o.bwd_peak + a[s]), o.fwd_time_s + o.bwd_time_s, Leaf(s, oi, None))
                else:
                    x = a[s + 1]
                    rp, rt, rtree = P[(s + 1, t)]
                    v = (max(o.fwd_peak + x, o.bwd_peak + x + a[s], o.kept + x + rp),
                         o.fwd_time_s + o.bwd_time_s + rt, Leaf(s, oi, rtree))
                if best is None or v[:2] < best[:2]:
                    best = v
            fwd_p, fwd_t = 0, 0.0
            for k in range(s + 1, t + 1):
                j = k - 1
                fwd_p = max(fwd_p, blocks[j].nr_peak + (a[j] if j > s else 0) + a[j + 1])
                fwd_t += blocks[j].nr_time_s
                rp, rt, rtree = P[(k, t)]
                lp, lt, ltree = P[(s, k - 1)]
                v = (max(fwd_p, a[k] + rp, a[k] + lp), fwd_t + rt + lt, Split(k, ltree, rtree))
                if v[:2] < best[:2]:
                    best = v
            P[(s, t)] = best
    peak, _, tree = P[(0, n - 1)]
    return peak, tree
