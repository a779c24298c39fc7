"""Layer clustering (Alpa's operator clustering DP) against brute force."""
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.pipeline.layer_clustering import OpSequence, cluster_layers, incoming_bytes
from autopar.pipeline.layers import op_sequence
from rockmate.graph import trace_graph


def random_sequence(rng):
    n = rng.randint(2, 8)
    flops = tuple(float(rng.randint(1, 10)) for _ in range(n))
    values = []
    for p in range(n - 1):
        for _ in range(rng.randint(0, 2)):
            cons = tuple(sorted(rng.sample(range(p + 1, n), rng.randint(1, min(2, n - p - 1)))))
            values.append((p, float(rng.randint(1, 100)), cons))
    return OpSequence(flops, tuple(values))


def cut_bytes(seq, start, end):
    """Bytes read by ops [start, end) from ops before start (each value once)."""
    return sum(b for p, b, cons in seq.values if p < start and any(start <= c < end for c in cons))


def brute_force(seq, L, delta):
    n = len(seq.flops)
    bound = (1 + delta) * sum(seq.flops) / L
    best = None
    for cuts in itertools.combinations(range(1, n), L - 1):
        b = [0, *cuts, n]
        if any(sum(seq.flops[b[i]:b[i + 1]]) > bound + 1e-9 for i in range(L)):
            continue
        per = [cut_bytes(seq, b[i], b[i + 1]) for i in range(1, L)]
        key = (max(per, default=0.0), sum(per))
        best = key if best is None or key < best else best
    return best


def test_incoming_bytes_matches_definition():
    rng = random.Random(0)
    for _ in range(50):
        seq = random_sequence(rng)
        C = incoming_bytes(seq)
        n = len(seq.flops)
        for i in range(n):
            for k in range(i, n):
                assert C[i, k] == cut_bytes(seq, i, k + 1)


def test_clustering_equals_brute_force():
    rng = random.Random(1)
    checked = 0
    for _ in range(200):
        seq = random_sequence(rng)
        L = rng.randint(1, len(seq.flops))
        delta = rng.choice([0.1, 0.5, 1.0])
        want = brute_force(seq, L, delta)
        if want is None:
            continue                         # the DP would relax delta; checked below
        got = cluster_layers(seq, L, delta)
        assert len(got.cuts) == L + 1 and got.cuts[0] == 0 and got.cuts[-1] == len(seq.flops)
        assert (got.max_cut_bytes, got.total_cut_bytes) == pytest.approx(want)
        checked += 1
    assert checked > 100


def test_balance_is_relaxed_only_when_infeasible():
    seq = OpSequence((10.0, 1.0, 1.0, 1.0), ())
    got = cluster_layers(seq, 2, delta=0.1)       # 10 alone exceeds 1.1 * 13 / 2
    assert got.cuts == (0, 1, 4)


def test_graph_sequence_keeps_forward_ops_in_order_and_counts_matmul_flops():
    def f(w1, w2, x):
        h = jnp.tanh(x @ w1)
        return jnp.sum(h @ w2)

    graph = trace_graph(f, jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((2, 8)))
    seq = op_sequence(graph)
    assert seq.flops[0] == 2 * 2 * 8 * 16 and seq.flops[2] == 2 * 2 * 16 * 4
    # ops: dot, tanh, dot, reduce_sum; the cheapest value to cut is the 2 x 4 float32
    # result of the second matmul (32 bytes), cheaper than the 2 x 16 tanh output
    cl = cluster_layers(seq, 2, delta=1.0)
    assert cl.cuts == (0, 3, 4) and cl.max_cut_bytes == 2 * 4 * 4
