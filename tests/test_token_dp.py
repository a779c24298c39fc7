"""TeraPipe's slicing DP and batch-split DP against brute force on small cost tables."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopar.pipeline.token_dp import (cost_table, fixed_schedule, item_depth, latency_s, slice_times,
                                       slicing_dp, token_dp, uniform_lengths)


def _compositions(n: int):
    """Every way to write n as an ordered sum of positive integers."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        out, run = [], 1
        for c in cuts:
            if c:
                out.append(run)
                run = 1
            else:
                run += 1
        yield tuple(out + [run])


def _partitions(n: int, sizes, largest=None):
    """Multisets of `sizes` summing to n (non-increasing)."""
    if n == 0:
        yield ()
        return
    for b in sorted(sizes, reverse=True):
        if b <= n and (largest is None or b <= largest):
            for rest in _partitions(n - b, sizes, b):
                yield (b,) + rest


def _brute(tables, batch, depth):
    best = np.inf
    for parts in _partitions(batch, list(tables)):
        per_size = {b: list(_compositions(tables[b].shape[0])) for b in set(parts)}
        for choice in itertools.product(*[per_size[b] for b in parts]):
            items = [t for b, ls in zip(parts, choice) for t in slice_times(tables[b], ls)]
            best = min(best, latency_s(items, depth))
    return best


def _random_table(rng, n, b=1):
    """A TeraPipe-like cost: a fixed per-slice overhead, linear in tokens, attention term in
    tokens x context, with noise so that ties are rare."""
    a, lin, att = rng.uniform(0.5, 2.0), rng.uniform(0.1, 1.0), rng.uniform(0.0, 0.2)
    noise = rng.uniform(0, 0.05, size=(n, n))
    return cost_table(lambda l, c: b * (lin * l + att * l * (l + c)) + a + noise[l - 1, c], n)


@pytest.mark.parametrize("seed", range(12))
def test_slicing_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    table = _random_table(rng, n)
    depth = float(rng.choice([0.0, 1.0, 3.0, 7.5]))
    got = slicing_dp(table, depth)
    assert got.latency_s == pytest.approx(_brute({1: table}, 1, depth), rel=1e-12)
    assert sum(got.slices[0]) == n
    assert got.latency_s == pytest.approx(latency_s(slice_times(table, got.slices[0]), depth))


@pytest.mark.parametrize("seed", range(10))
def test_joint_batch_split_equals_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 6))
    batch = int(rng.integers(1, 6))
    sizes = sorted(set(int(b) for b in rng.integers(1, batch + 1, size=3)) | {1})
    tables = {b: _random_table(rng, n, b) for b in sizes}
    depth = float(rng.choice([1.0, 3.0, 7.0]))
    got = token_dp(tables, batch, depth, chunk=int(rng.choice([1, 3, 256])))
    assert got.latency_s == pytest.approx(_brute(tables, batch, depth), rel=1e-12)
    assert sum(got.micro_batch_sizes) == batch
    assert all(sum(s) == n for s in got.slices)


def test_early_exit_skips_bounds_and_stays_optimal():
    # Deep pipeline, attention-free cost: many bounds, the best is found early.
    table = cost_table(lambda l, c: 1.0 + l, 24)
    got = token_dp({1: table}, 1, 47.0, chunk=1)
    distinct = len(np.unique(table[np.isfinite(table)]))
    assert got.bounds_tried < distinct
    # Closed form: k equal slices cost k + 24 + 47 * (1 + 24 / k); best k with k | 24
    best = min(k + 24 + 47.0 * (1 + 24 / k) for k in range(1, 25) if 24 % k == 0)
    assert got.latency_s <= best + 1e-9


def test_granularity_and_uniform_lengths():
    assert uniform_lengths(10, 3) == (4, 3, 3)
    assert uniform_lengths(16, 2, granularity=4) == (8, 8)
    with pytest.raises(ValueError, match="cannot cut 8 tokens into 9"):
        uniform_lengths(8, 9)
    table = cost_table(lambda l, c: 1.0 + 0.1 * l * (l + c), 16, granularity=4)
    assert table.shape == (4, 4)
    got = slicing_dp(table, 3.0, granularity=4)
    assert sum(got.slices[0]) == 16 and all(l % 4 == 0 for l in got.slices[0])
    fixed = fixed_schedule({1: table}, [1], uniform_lengths(16, 2, 4), 3.0, granularity=4)
    assert got.latency_s <= fixed.latency_s


def test_item_depth_matches_alpa_and_terapipe():
    assert item_depth([2.0, 2.0, 2.0, 2.0]) == 3.0           # TeraPipe: stages - 1
    stage = [1.0, 3.0, 2.0]
    B = 5                                                     # B equal items: Alpa's latency
    assert latency_s([max(stage)] * B, item_depth(stage)) == pytest.approx(sum(stage) + (B - 1) * max(stage))
