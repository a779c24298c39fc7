"""Find repeated layers in an op sequence: tandem repeats of op signatures.

An unrolled 24-layer model has its forward ops, its backward ops and its optimizer update
each as 24 back-to-back copies of one segment. The intra-op planner ties every copy to the
first (they must pick the same strategies), which shrinks the ILP to about one layer's size
whatever the depth, the same restriction a `scan` over layers imposes.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def tandem_repeats(signatures: Sequence[Hashable], min_period: int = 4, min_copies: int = 2) -> list[tuple[int, int, int]]:
    """Non-overlapping tandem repeats as (start, period, copies), chosen greedily by the
    number of positions they tie. The i-th copy occupies start + i*period ... + period."""
    ids: dict[Hashable, int] = {}
    s = np.array([ids.setdefault(x, len(ids)) for x in signatures], dtype=np.int64)
    n = len(s)
    candidates = []
    for m in range(min_period, n // min_copies + 1):
        eq = s[:-m] == s[m:]
        if not eq.any():
            continue
        padded = np.concatenate([[False], eq, [False]])
        starts = np.nonzero(~padded[:-1] & padded[1:])[0]
        ends = np.nonzero(padded[:-1] & ~padded[1:])[0]
        for a, b in zip(starts, ends):
            length = b - a                      # s[i] == s[i+m] for a <= i < b
            copies = length // m + 1
            if copies >= min_copies:
                candidates.append((m * (copies - 1), int(a), m, int(copies)))
    candidates.sort(key=lambda c: (-c[0], c[2], c[1]))
    taken = np.zeros(n, dtype=bool)
    chosen = []
    for _, a, m, k in candidates:
        # trim copies that overlap what is already taken (keep a prefix of whole copies)
        while k >= min_copies and taken[a: a + m * k].any():
            if not taken[a: a + m].any() and taken[a + m * (k - 1): a + m * k].any():
                k -= 1
            else:
                break
        if k >= min_copies and not taken[a: a + m * k].any():
            taken[a: a + m * k] = True
            chosen.append((a, m, k))
    return sorted(chosen)


def representatives(n: int, repeats: Sequence[tuple[int, int, int]]) -> list[int]:
    """rep[i]: the position in the first copy that position i is tied to (i itself if untied)."""
    rep = list(range(n))
    for a, m, k in repeats:
        for i in range(a + m, a + m * k):
            rep[i] = a + (i - a) % m
    return rep
