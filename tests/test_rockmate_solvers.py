"""The block ILP and the sequence DP against brute force on small random instances, the
infeasible-budget error, budget parsing and the plan's JSON round trip."""
import itertools
import json
import random

import jax
import jax.numpy as jnp
import pytest

import rockmate
from rockmate.block_ilp import solve_block
from rockmate.block_graph import BlockGraph
from rockmate.sequence_dp import ChainBlock, ChainOption, Leaf, Split, min_peak, solve_chain
from rockmate.budget import parse_bytes


def random_block(rng: random.Random, n: int) -> BlockGraph:
    deps = tuple(tuple(sorted(rng.sample(range(i), k=min(i, rng.randint(0, 2))))) for i in range(n))
    sizes = tuple(rng.choice([0, 1, 2, 4, 8]) * 100 for _ in range(n))
    live = tuple(s if rng.random() < 0.8 else 0 for s in sizes)
    residuals = frozenset(i for i in range(n) if rng.random() < 0.6)
    keepable = frozenset(i for i in range(n) if rng.random() < 0.9)
    views = tuple((i, deps[i][0]) for i in range(n) if deps[i] and sizes[i] == 0 and rng.random() < 0.5)
    return BlockGraph(sizes, live, tuple(rng.uniform(0.1, 3.0) for _ in range(n)),
                      tuple(rng.uniform(0.1, 3.0) for _ in range(n)), deps, residuals, keepable,
                      100, 100, 50, rng.choice([0, 100, 300]), views=views)


def brute_force_block(g: BlockGraph, limit: float):
    """Least recomputation time over every keep set (the recompute set is then forced)."""
    n = len(g.sizes_bytes)
    best = None
    for mask in range(1 << n):
        kept = {i for i in range(n) if mask >> i & 1}
        if not kept <= g.keepable or any(v in kept and s not in kept for v, s in g.views):
            continue
        rec, stack = set(), [i for i in g.residuals if i not in kept]
        while stack:
            i = stack.pop()
            if i not in rec:
                rec.add(i)
                stack.extend(j for j in g.deps[i] if j not in kept)
        peak = sum(g.sizes_bytes[i] for i in kept) + sum(g.live_bytes[i] for i in rec) + g.bwd_ws_bytes
        if peak <= limit:
            t = sum(g.times_s[i] for i in rec)
            best = t if best is None else min(best, t)
    return best


def test_block_ilp_equals_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        g = random_block(rng, rng.randint(1, 8))
        hi = sum(g.sizes_bytes) + sum(g.live_bytes) + g.bwd_ws_bytes
        limit = rng.uniform(g.bwd_ws_bytes, hi)
        bf = brute_force_block(g, limit)
        opt = solve_block(g, limit)
        if bf is None:
            assert opt is None, trial
            continue
        assert opt is not None, trial
        got = sum(g.times_s[i] for i in opt.recomputed)
        assert got == pytest.approx(bf, abs=1e-6), trial
        assert opt.bwd_peak_bytes <= limit


def random_chain(rng: random.Random, n: int):
    blocks = []
    for _ in range(n):
        opts = []
        for _ in range(rng.randint(1, 3)):
            kept = rng.randint(0, 6)
            opts.append(ChainOption(rng.uniform(1, 2), rng.uniform(1, 4), kept,
                                    kept + rng.randint(0, 3), kept + rng.randint(0, 5)))
        blocks.append(ChainBlock(tuple(opts), rng.uniform(1, 2), rng.randint(0, 3)))
    a = [0] + [rng.randint(1, 3) for _ in range(n - 1)] + [0]
    return blocks, a


def all_schedules(blocks, s, t):
    """Every schedule tree of Seq(s..t)."""
    for oi in range(len(blocks[s].options)):
        if s == t:
            yield Leaf(s, oi, None)
        else:
            for rest in all_schedules(blocks, s + 1, t):
                yield Leaf(s, oi, rest)
    for k in range(s + 1, t + 1):
        for left in all_schedules(blocks, s, k - 1):
            for right in all_schedules(blocks, k, t):
                yield Split(k, left, right)


def cost(blocks, a, tree, s, t):
    """Independent evaluation of a tree: (time, peak) under the memory rules of the DP."""
    if isinstance(tree, Leaf):
        o = blocks[s].options[tree.option]
        if tree.rest is None:
            return o.fwd_time_s + o.bwd_time_s, max(o.fwd_peak, o.bwd_peak + a[s])
        rt, rp = cost(blocks, a, tree.rest, s + 1, t)
        x = a[s + 1]
        return o.fwd_time_s + o.bwd_time_s + rt, max(o.fwd_peak + x, o.bwd_peak + x + a[s], o.kept + x + rp)
    k = tree.at
    lt, lp = cost(blocks, a, tree.left, s, k - 1)
    rt, rp = cost(blocks, a, tree.right, k, t)
    fwd = [blocks[j].nr_peak + (a[j] if j > s else 0) + a[j + 1] for j in range(s, k)]
    return (sum(blocks[j].nr_time_s for j in range(s, k)) + lt + rt,
            max(max(fwd), a[k] + lp, a[k] + rp))


def test_sequence_dp_equals_brute_force():
    rng = random.Random(1)
    for trial in range(60):
        n = rng.randint(1, 5)
        blocks, a = random_chain(rng, n)
        trees = [(cost(blocks, a, tr, 0, n - 1), tr) for tr in all_schedules(blocks, 0, n - 1)]
        lowest = min(p for (_, p), _ in trees)
        assert min_peak(blocks, a)[0] == lowest, trial
        for budget in range(0, lowest + 12, 2):
            fits = [tm for (tm, p), _ in trees if p <= budget]
            res = solve_chain(blocks, a, budget)
            if not fits:
                assert res is None, (trial, budget)
                continue
            assert res is not None, (trial, budget)
            assert res[0] == pytest.approx(min(fits)), (trial, budget)
            t_tree, p_tree = cost(blocks, a, res[1], 0, n - 1)
            assert t_tree == pytest.approx(res[0]) and p_tree <= budget


def small_mlp():
    key = jax.random.PRNGKey(0)
    params = [(jax.random.normal(jax.random.fold_in(key, i), (32, 64)) * 0.2,
               jax.random.normal(jax.random.fold_in(key, 9 + i), (64, 32)) * 0.2) for i in range(4)]
    x = jax.random.normal(key, (64, 32))

    def f(params, x):
        h = x
        for a, b in params:
            h = h + jnp.tanh(h @ a) @ b
        return jnp.sum(h ** 2)
    return f, params, x


def test_budget_below_minimum_is_a_clear_error():
    f, params, x = small_mlp()
    lo = rockmate.min_budget(f, params, x, calibrate=False)
    with pytest.raises(rockmate.InfeasibleBudgetError) as e:
        rockmate.remat(f, lo - 1, params, x, calibrate=False)
    assert isinstance(e.value, ValueError)
    assert e.value.min_budget_bytes == lo
    assert str(lo) in str(e.value) and "minimum" in str(e.value)
    rockmate.remat(f, lo, params, x, calibrate=False)  # the minimum itself is reachable


def test_plan_json_round_trip_and_apply():
    f, params, x = small_mlp()
    plan = rockmate.plan_remat(f, "10MB", params, x, calibrate=False)
    d = json.loads(json.dumps(plan.to_json()))
    again = rockmate.RematPlan.from_json(d)
    assert again == plan
    f2 = rockmate.apply_plan(f, d)
    g, ref = jax.grad(f2)(params, x), jax.grad(f)(params, x)
    for u, v in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
        assert jnp.allclose(u, v, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="different program"):
        f2(params, jnp.ones((8, 32)))
    assert "block" in plan.summary()


def test_parse_budget():
    assert parse_bytes("200MB") == 200 * 10**6
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes(12345) == 12345
    for bad in ["lots", "-3MB", 0, "12 parsecs"]:
        with pytest.raises(ValueError):
            parse_bytes(bad)
