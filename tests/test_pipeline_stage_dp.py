"""Stage DP (Alpa) against brute force on random small cost tensors, and submeshes."""
import itertools
import random

import numpy as np
import pytest

from autopar.pipeline.stage_dp import stage_dp
from autopar.cluster import Cluster
from autopar.pipeline.submesh import assign_devices, logical_mesh_shapes


def valid_pipelines(time, mem, limit, sizes, N, num_stages=None):
    """Every split of the layers into contiguous stages and every submesh per stage that
    uses all N devices with every stage finite and within the memory limit: each as its
    stages' (first layer, last layer, submesh, stages from it - 1)."""
    L, _, M, S = time.shape
    for s in range(1, S + 1):
        if num_stages is not None and s != num_stages:
            continue
        for cuts in itertools.combinations(range(1, L), s - 1):
            bounds = [0, *cuts, L]
            for subs in itertools.product(range(M), repeat=s):
                if sum(sizes[m] for m in subs) != N:
                    continue
                cells = [(bounds[n], bounds[n + 1] - 1, m, s - 1 - n) for n, m in enumerate(subs)]
                if all(np.isfinite(time[c]) and mem[c] <= limit for c in cells):
                    yield cells


def brute_force(time, it, mem, limit, sizes, N, B, num_stages=None):
    """The least latency over `valid_pipelines`."""
    return min((sum(time[c] + it[c] for c in cells) + (B - 1) * max(time[c] for c in cells)
                for cells in valid_pipelines(time, mem, limit, sizes, N, num_stages)), default=np.inf)


def random_instance(rng):
    L = rng.randint(1, 5)
    sizes = [1, 2, 4]
    N = rng.choice([1, 2, 4, 6, 8])
    S = rng.randint(1, min(L, N))
    shape = (L, L, len(sizes), S)
    nprng = np.random.default_rng(rng.randint(0, 10**6))
    # time falls with more devices, with noise; some entries impossible
    layer_work = nprng.uniform(0.5, 2.0, size=L)
    time = np.empty(shape)
    for i in range(L):
        for j in range(L):
            for m, d in enumerate(sizes):
                time[i, j, m, :] = layer_work[i:j + 1].sum() / d ** nprng.uniform(0.5, 1.0) \
                    + nprng.uniform(0, 0.3, size=S)
    time[nprng.random(shape) < 0.1] = np.inf
    it = nprng.uniform(0, 0.5, size=shape)
    mem = nprng.uniform(0, 10, size=shape) * (1 + np.arange(S))  # more in flight, more memory
    limit = rng.choice([np.inf, 15.0, 25.0])
    B = rng.choice([1, 2, 4, 8])
    return time, it, mem, limit, sizes, N, B


def test_stage_dp_equals_brute_force_on_random_instances():
    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        time, it, mem, limit, sizes, N, B = random_instance(rng)
        fixed = rng.choice([None, None, rng.randint(1, time.shape[3])])
        want = brute_force(time, it, mem, limit, sizes, N, B, fixed)
        if not np.isfinite(want):
            with pytest.raises(ValueError, match="no pipeline fits"):
                stage_dp(time, sizes, N, B, iteration_s=it, memory_bytes=mem,
                         memory_limit_bytes=limit, num_stages=fixed)
            continue
        got = stage_dp(time, sizes, N, B, iteration_s=it, memory_bytes=mem,
                       memory_limit_bytes=limit, num_stages=fixed)
        assert got.latency_s == pytest.approx(want, rel=1e-9)
        # the returned stages really have that latency and respect every constraint
        S = len(got.stages)
        assert got.stages[0].start == 0 and got.stages[-1].end == time.shape[0]
        assert sum(sizes[c.submesh] for c in got.stages) == N
        ts = [time[c.start, c.end - 1, c.submesh, S - 1 - n] for n, c in enumerate(got.stages)]
        total = sum(time[c.start, c.end - 1, c.submesh, S - 1 - n] + it[c.start, c.end - 1, c.submesh, S - 1 - n]
                    for n, c in enumerate(got.stages))
        assert all(mem[c.start, c.end - 1, c.submesh, S - 1 - n] <= limit for n, c in enumerate(got.stages))
        assert total + (B - 1) * max(ts) == pytest.approx(got.latency_s, rel=1e-9)
        checked += 1
    assert checked > 80


def test_imbalance_tolerance_prunes_within_its_bound():
    rng = random.Random(1)
    fewer = 0
    for _ in range(60):
        time, it, mem, limit, sizes, N, B = random_instance(rng)
        try:
            exact = stage_dp(time, sizes, N, B, iteration_s=it, memory_bytes=mem, memory_limit_bytes=limit)
        except ValueError:
            continue
        eps = 0.2
        pruned = stage_dp(time, sizes, N, B, iteration_s=it, memory_bytes=mem,
                          memory_limit_bytes=limit, imbalance_tolerance=eps)
        assert exact.latency_s - 1e-9 <= pruned.latency_s <= (1 + eps) * exact.latency_s + 1e-9
        fewer += pruned.bounds_tried < exact.bounds_tried
    assert fewer > 0


def test_submesh_shapes_and_logical_meshes():
    assert Cluster.preset("a100-80g", 2, 8).submesh_shapes() == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
    assert Cluster.preset("a100-80g", 1, 1).submesh_shapes() == [(1, 1)]
    assert logical_mesh_shapes((2, 8)) == [(2, 8), (4, 4), (8, 2), (16, 1)]   # model axis inside a host
    assert logical_mesh_shapes((1, 4)) == [(1, 4), (2, 2), (4, 1)]


def test_assign_devices_covers_the_cluster_exactly():
    rng = random.Random(2)
    placed = 0
    for _ in range(200):
        H, M = rng.choice([(1, 8), (2, 8), (4, 4), (3, 8)])
        shapes, left = [], H * M
        while left:
            opts = [s for s in Cluster.preset("a100-80g", H, M).submesh_shapes() if s[0] * s[1] <= left
                    and (s[1] == M or s[0] * s[1] <= left % M or left % M == 0)]
            s = rng.choice(opts)
            shapes.append(s)
            left -= s[0] * s[1]
        try:
            ids = assign_devices(shapes, H, M)
        except ValueError:
            continue
        placed += 1
        flat = sorted(i for group in ids for i in group)
        assert flat == list(range(H * M))
        for (n, m), group in zip(shapes, ids):
            assert len(group) == n * m
            if n == 1:
                assert len({i // M for i in group}) == 1          # inside one host
    assert placed > 150
    with pytest.raises(ValueError, match="use 4 devices"):
        assign_devices([(1, 4)], 1, 8)


def test_stage_dp_with_intra_stage_options_equals_brute_force():
    """With several options per stage (logical mesh shapes) the DP equals brute force
    over every option of every stage."""
    rng = random.Random(3)
    checked = 0
    for _ in range(80):
        time0, it0, mem0, limit, sizes, N, B = random_instance(rng)
        nprng = np.random.default_rng(rng.randint(0, 10**6))
        # option 1 trades per-micro-batch time for per-step time and memory, option 2 random
        time = np.stack([time0, time0 * 0.7, time0 * nprng.uniform(0.5, 1.5, time0.shape)], -1)
        it = np.stack([it0, it0 + 0.8, nprng.uniform(0, 0.5, time0.shape)], -1)
        mem = np.stack([mem0, mem0 * 1.5, nprng.uniform(0, 10, time0.shape)], -1)
        # brute force: fold the options into extra "submeshes" of the same size
        L, _, M, S, K = time.shape
        flat = lambda a: a.transpose(0, 1, 2, 4, 3).reshape(L, L, M * K, S)
        want = brute_force(flat(time), flat(it), flat(mem), limit,
                           [sz for sz in sizes for _ in range(K)], N, B)
        if not np.isfinite(want):
            continue
        got = stage_dp(time, sizes, N, B, iteration_s=it, memory_bytes=mem, memory_limit_bytes=limit)
        assert got.latency_s == pytest.approx(want, rel=1e-9)
        checked += 1
    assert checked > 15


def test_least_feasible_bound_is_the_least_slowest_stage_of_any_pipeline():
    """The bound the stage DP starts its enumeration from (one bottleneck DP in place of a
    bisection over feasibility) is the least max stage time over all valid pipelines."""
    from autopar.pipeline.stage_dp import _least_feasible_bound

    rng = random.Random(3)
    feasible = 0
    for _ in range(150):
        time, it, mem, limit, sizes, N, B = random_instance(rng)
        L, _, M, S = time.shape
        fixed = rng.choice([None, rng.randint(1, S)])
        want = min((max(time[c] for c in cells) for cells in valid_pipelines(time, mem, limit, sizes, N, fixed)),
                   default=np.inf)
        fastest = np.where(np.triu(np.ones((L, L), bool))[:, :, None, None] & (mem <= limit), time, np.inf)
        got = _least_feasible_bound(fastest, np.array(sizes), N, list(range(1, S + 1)) if fixed is None else [fixed])
        assert got == want
        feasible += np.isfinite(want)
    assert feasible > 50
