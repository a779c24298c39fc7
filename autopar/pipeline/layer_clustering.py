"""Alpa's operator clustering: cut an op sequence into L contiguous layers.

G(k, r) = min over i <= k of max(G(i-1, r-1), C(i, k))  subject to
FLOPs(i..k) <= (1 + delta) * total / L, where C(i, k) is the bytes that ops i..k read
from ops before i. The DP minimises the largest cut; a second DP then minimises the total
bytes crossing cuts among the clusterings that reach that maximum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class OpSequence:
    """Plain data for clustering: per-op FLOPs and the values flowing between ops.

    `values` holds (producer op, bytes, consumer ops) for every value an op produces and
    a later op reads (parameters and inputs are not listed: they live with the stage).
    """

    flops: tuple[float, ...]
    values: tuple[tuple[int, float, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Clustering:
    """Layer boundaries [0, c1, ..., n] over ops, the largest and total cut bytes."""

    cuts: tuple[int, ...]
    max_cut_bytes: float
    total_cut_bytes: float


def incoming_bytes(seq: OpSequence) -> np.ndarray:
    """C[i, k]: bytes that ops i..k read from ops before i (distinct values counted once)."""
    n = len(seq.flops)
    D = np.zeros((n + 1, n + 1))      # 2-D difference array of rectangles
    for p, b, consumers in seq.values:
        prev = p
        for c in sorted(set(consumers)):
            if c <= prev:
                continue
            # ranges [i, k] with prev < i <= c and k >= c first read the value at op c
            D[prev + 1, c] += b
            D[c + 1, c] -= b
            prev = c
    return np.cumsum(np.cumsum(D, axis=0), axis=1)[:n, :n]


def cluster_layers(seq: OpSequence, num_layers: int, delta: float = 0.5) -> Clustering:
    """Best clustering into exactly `num_layers` layers under the FLOP balance bound;
    the bound is relaxed (delta doubled) until a clustering exists."""
    n = len(seq.flops)
    if not 1 <= num_layers <= n:
        raise ValueError(f"cannot cluster {n} ops into {num_layers} layers")
    flops = np.asarray(seq.flops, dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    span = prefix[None, 1:] - prefix[:-1, None]          # span[i, k] = FLOPs of ops i..k
    C = incoming_bytes(seq)
    C[0, :] = 0.0
    while True:
        bound = (1 + delta) * prefix[-1] / num_layers
        allowed = (span <= bound + 1e-9 * max(prefix[-1], 1.0)) & np.triu(np.ones((n, n), bool))
        best_max = _dp(C, allowed, num_layers, combine=np.maximum)[0]
        if np.isfinite(best_max):
            break
        delta = delta * 2 + 0.1
    total, cuts = _dp(C, allowed & (C <= best_max), num_layers, combine=np.add)
    return Clustering(tuple(cuts), float(best_max), float(total))


def _dp(C: np.ndarray, allowed: np.ndarray, L: int, combine) -> tuple[float, list[int]]:
    """G[r][k] = best value of ops 0..k-1 in r layers, the last layer ending at op k-1."""
    n = C.shape[0]
    cost = np.where(allowed, C, np.inf)                  # layer = ops i..k
    G = np.full(n + 1, np.inf)
    G[0] = 0.0
    args = []
    for r in range(1, L + 1):
        newG = np.full(n + 1, np.inf)
        arg = np.zeros(n + 1, dtype=np.int64)
        for k in range(1, n + 1):                         # layer ends at op k-1, starts at i
            vals = combine(G[:k], cost[:k, k - 1])
            i = int(np.argmin(vals))
            newG[k], arg[k] = vals[i], i
        G = newG
        args.append(arg)
    if not np.isfinite(G[n]):
        return np.inf, []
    cuts, k = [n], n
    for r in range(L, 0, -1):
        k = int(args[r - 1][k])
        cuts.append(k)
    return float(G[n]), cuts[::-1]
