"""The joint pipeline planner's parts against independent references: the lazy stage DP
against the DP on fully priced costs, the choice of micro-batches against brute force,
roofline bounds against the ILP, layers found from repeated blocks, the layer train
graph against jax.vjp, and stage costs composed from their layers."""
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar.cluster import Cluster
from autopar.pipeline.layer_cost import LayerSolver, per_device_bytes, shrinks_evenly, solve_layer
from autopar.pipeline.layer_graph import trace_layer
from autopar.pipeline.layers import cut_layers, repeat_cuts
from autopar.pipeline.best_first import Refinement, best_first, bound_then_exact
from autopar.pipeline.planner import optimizer_state_factor
from autopar.pipeline.stage import compose, stage_layers
from autopar.pipeline.stage_dp import lazy_stage_dp, lazy_stage_dp_steps, stage_dp
from autopar.pipeline.trace import StepTracer
from autopar.resharding import reshard_cost
from pipeline_gpt import LAYERS, init_state, make_batch, make_step
from rockmate.graph.evaluate import eval_ops
from test_pipeline_stage_dp import random_instance


def _lazy_instance(rng):
    """Random exact stage costs, and lower bounds of them (time and memory scaled down)."""
    time, it, mem, limit, sizes, N, B = random_instance(rng)
    nprng = np.random.default_rng(rng.randint(0, 10**6))
    shrink = nprng.uniform(0.3, 1.0, time.shape[:3])[..., None].repeat(time.shape[3], -1)
    return (time, it, mem), (time * shrink, it * 0, mem * shrink), limit, sizes, N, B


def test_lazy_stage_dp_equals_the_dp_on_fully_priced_costs():
    """Pricing only what the DP's solution uses, until it uses nothing unpriced, gives the
    optimum of the fully priced problem, and usually prices a fraction of the candidates."""
    rng = random.Random(11)
    checked, priced_fraction = 0, []
    for _ in range(120):
        exact, bound, limit, sizes, N, B = _lazy_instance(rng)
        try:
            want = stage_dp(exact[0], sizes, N, B, iteration_s=exact[1], memory_bytes=exact[2],
                            memory_limit_bytes=limit).latency_s
        except ValueError:
            continue
        cur = [x.copy() for x in bound]
        priced = set()

        def price(st, s):
            key = (st.start, st.end - 1, st.submesh)
            priced.add(key)
            for a, b in zip(cur, exact):
                a[key] = b[key]

        got = lazy_stage_dp(lambda: cur, lambda st, s: (st.start, st.end - 1, st.submesh) in priced, price,
                            sizes, N, B, memory_limit_bytes=limit)
        assert got.latency_s == pytest.approx(want, rel=1e-9)
        L, _, M, _ = exact[0].shape
        priced_fraction.append(len(priced) / (L * (L + 1) / 2 * M))
        checked += 1
    assert checked > 40
    assert np.mean(priced_fraction) < 0.8


def test_choice_of_micro_batches_equals_brute_force():
    """best_first over B (lower bounds from cheap tensors, exact latencies from the DP)
    picks the B a brute force over every B and the fully priced DP picks."""
    rng = random.Random(5)
    checked = 0
    for _ in range(40):
        L = rng.randint(1, 4)
        instances = {}
        for B in (1, 2, 4, 8):
            while True:
                exact, bound, limit, sizes, N, _ = _lazy_instance(rng)
                if exact[0].shape[0] == L:
                    break
            # per micro-batch time shrinks with the micro-batch; memory of activations too
            exact = (exact[0] / B, exact[1], exact[2] / B)
            bound = (bound[0] / B, bound[1], bound[2] / B)
            instances[B] = (exact, bound, limit, sizes, N)

        def full(B):
            (t, it, mem), _, limit, sizes, N = instances[B]
            return stage_dp(t, sizes, N, B, iteration_s=it, memory_bytes=mem, memory_limit_bytes=limit).latency_s

        def lower(B):
            _, (t, it, mem), limit, sizes, N = instances[B]
            return stage_dp(t, sizes, N, B, iteration_s=it, memory_bytes=mem, memory_limit_bytes=limit).latency_s

        brute = {}
        for B in instances:
            try:
                brute[B] = full(B)
            except ValueError:
                pass
        if not brute:
            with pytest.raises(ValueError):
                best_first(list(instances), bound_then_exact(lower, full))
            continue
        found = best_first(list(instances), bound_then_exact(lower, full))
        got, latency = found.candidate, found.latency_s
        want = min(brute, key=lambda b: (brute[b], b))
        assert latency == pytest.approx(brute[want], rel=1e-12)
        assert brute[got] == pytest.approx(brute[want], rel=1e-12)
        checked += 1
    assert checked > 20


def test_best_first_over_lazy_dps_equals_brute_force_and_prices_less():
    """Several lazy stage DPs (one per B) refined best-first, one solve at a time: the
    result is the brute-force best over all of them (within the tolerance asked), and no
    DP prices more than it would refined to the end on its own."""
    rng = random.Random(23)
    checked, saved = 0, 0
    for _ in range(30):
        instances = []
        while len(instances) < 4:
            exact, bound, limit, sizes, N, B = _lazy_instance(rng)
            try:
                want = stage_dp(exact[0], sizes, N, B, iteration_s=exact[1], memory_bytes=exact[2],
                                memory_limit_bytes=limit).latency_s
            except ValueError:
                want = np.inf
            instances.append((exact, bound, limit, sizes, N, B, want))
        brute = min(x[-1] for x in instances)

        def steps(i, counts, tolerance):
            exact, bound, limit, sizes, N, B, _ = instances[i]
            cur = [x.copy() for x in bound]
            mask = np.zeros(exact[0].shape, bool)

            def price(st, s):
                key = (st.start, st.end - 1, st.submesh)
                counts[i] += 1
                mask[key] = True
                for a, b in zip(cur, exact):
                    a[key] = b[key]

            return lazy_stage_dp_steps(lambda: cur, lambda st, s: mask[st.start, st.end - 1, st.submesh].all(),
                                       price, sizes, N, B, memory_limit_bytes=limit,
                                       priced=(lambda: mask) if tolerance else None)

        def run(i, counts, tolerance):
            _, bound, limit, sizes, N, B, _ = instances[i]
            yield Refinement(lower_s=stage_dp(bound[0], sizes, N, B, iteration_s=bound[1], memory_bytes=bound[2],
                                              memory_limit_bytes=limit).latency_s)
            yield from steps(i, counts, tolerance)

        for tolerance in (0.0, 0.1):
            counts = [0] * 4
            if not np.isfinite(brute):
                with pytest.raises(ValueError):
                    best_first(list(range(4)), lambda i: run(i, counts, tolerance), tolerance)
                continue
            found = best_first(list(range(4)), lambda i: run(i, counts, tolerance), tolerance)
            assert brute * (1 - 1e-9) <= found.latency_s <= brute * (1 + tolerance) * (1 + 1e-9)
            assert found.latency_s >= instances[found.candidate][-1] * (1 - 1e-9)   # a real plan of that B
            alone = [0] * 4
            for i in range(4):
                try:        # as lazy_stage_dp: to the optimum, or a plan within the tolerance
                    for r in steps(i, alone, tolerance):
                        if r.upper_s <= r.lower_s * (1 + tolerance):
                            break
                except ValueError:
                    pass
            assert all(a <= b for a, b in zip(counts, alone))
            saved += sum(alone) - sum(counts)
            checked += 1
    assert checked > 30
    assert saved > 0


@pytest.fixture(scope="module")
def traced():
    opt = optax.adamw(1e-2)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(0), 8)
    return StepTracer(make_step(opt, closure=True), (state, batch)).at(2), state, batch


def test_layers_follow_the_repeated_blocks(traced):
    """The four transformer blocks become layers with one content key; the embedding and
    the head are layers of their own."""
    t, _, _ = traced
    cuts = repeat_cuts(t.loss)
    layers = cut_layers(t.loss, cuts, t.diff_mask)
    graphs = [trace_layer(t.loss, spec) for spec in layers]
    keys = [lg.key for lg in graphs]
    assert len(layers) == LAYERS + 2 or len(layers) == LAYERS + 1
    assert len(set(keys[1:LAYERS])) == 1 and keys[0] != keys[1] and keys[-1] != keys[1]
    assert sum(len(l.param_inputs) for l in layers) >= sum(t.diff_mask)   # the tied embedding: read twice


def test_blocks_named_as_flax_names_them_share_one_key():
    """Blocks in a dict keyed "h_0" .. "h_10" (flax's naming) reach the loss's inputs in
    pytree order ("h_10" before "h_2"), so the blocks' parameters interleave differently;
    every block still lists its inputs alike and gets the one content key (one ILP per
    mesh for all of them)."""
    from autopar.pipeline.grad import value_and_grad
    from pipeline_gpt import _block, init_params

    n = 12
    blocks = init_params(jax.random.PRNGKey(0), layers=n)["blocks"]
    params = {"blocks": {f"h_{i}": p for i, p in enumerate(blocks)}}

    def loss(params, x):
        for i in range(n):
            x = _block(params["blocks"][f"h_{i}"], x)
        return (x ** 2).mean()

    def step(params, x):
        value, grads = value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    t = StepTracer(step, (params, jnp.ones((2, 8, 32)))).at(1)
    blocks_at = repeat_cuts(t.loss)
    assert len(blocks_at) == n + 2          # [0, 1): the loss's first op; then one layer per block
    # h_0, layers of two blocks (h_1, h_2) .. (h_9, h_10) as the planner's clustering may cut, h_11
    cuts = [0, *blocks_at[2:-1:2], blocks_at[-1]]
    pairs = [s for s in cut_layers(t.loss, cuts, t.diff_mask) if len(s.param_inputs) == 12]
    assert len(pairs) == 5
    assert [k for k, _ in jax.tree_util.tree_flatten_with_path(params["blocks"])[0][::6]][2][0].key == "h_10"
    assert len({trace_layer(t.loss, s).key for s in pairs}) == 1


def test_layer_train_graph_equals_jax_vjp(traced):
    """The layer's forward ops, then its backward ops on the residuals alone, give jax.vjp's
    outputs and gradients."""
    t, state, batch = traced
    layers = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
    lg = trace_layer(t.loss, layers[1])
    g = lg.graph
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(size=g.vars[v].shape), g.vars[v].abstract().dtype) for v in g.invars]
    env = dict(zip(g.invars, args))
    eval_ops(g, env, range(lg.num_forward_ops))
    outs = [env[v] for v in lg.out_vars]
    kept = {v: env[v] for v in lg.residuals}
    kept.update({v: env[v] for v in lg.backward_reads_params})
    kept.update({v: env[v] for v in lg.ct_vars if v is not None})
    eval_ops(g, kept, range(lg.num_forward_ops, len(g.ops)))      # the backward sees only these
    grads = [kept[v] if v in kept else env[v] for v in g.outvars[len(lg.out_vars):]]

    from autopar.pipeline.layer_graph import layer_forward
    fwd = layer_forward(t.loss, lg.spec)
    n_p = len(lg.spec.param_inputs)
    params, acts = args[:n_p], args[n_p:n_p + len(lg.spec.in_acts)]

    def f(p, a):
        env2 = fwd(p, (), a)
        return tuple(env2[v] for v in lg.spec.out_acts)

    ref_out, vjp = jax.vjp(f, tuple(params), tuple(acts))
    ref_gp, ref_ga = vjp(tuple(args[-len(lg.spec.out_acts):]))
    for a, b in zip(outs, ref_out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, (*ref_gp, *ref_ga)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def layer_solver():
    """One solver for the bound tests: they check the same solutions (solves are cached)."""
    return LayerSolver()


def test_roofline_bound_is_below_the_ilp_on_every_mesh(traced, layer_solver):
    t, _, _ = traced
    layers = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
    cluster = Cluster.parse("2x4:a100-80g")
    solver = layer_solver
    for spec in (layers[0], layers[1], layers[-1]):
        for remat in ("none", "rockmate", "full"):      # a remat option's bound counts its recomputation
            lg = trace_layer(t.loss, spec, remat)
            for shape in [(1, 1), (1, 4), (2, 2), (2, 4), (8, 1)]:
                mesh = cluster.logical_mesh(shape)
                assert solver.lower_bound(lg, mesh) <= solver(lg, mesh).time_s * (1 + 1e-9)


def test_unsharded_working_memory_over_the_devices_bounds_every_layout(traced, layer_solver):
    """The planner's memory bound for an unpriced candidate: a layer's working memory at
    unsharded sizes over n is at most the working memory of the ILP's layouts on any mesh
    of n devices, for every remat option's train graph."""
    from autopar.pipeline.layer_cost import global_working_bytes

    t, _, _ = traced
    layers = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
    cluster = Cluster.parse("2x4:a100-80g")
    solver = layer_solver
    for remat in ("none", "rockmate", "full"):
        for spec in (layers[0], layers[1], layers[-1]):
            lg = trace_layer(t.loss, spec, remat)
            bound = global_working_bytes(lg)
            for shape in [(1, 1), (1, 4), (2, 2), (2, 4), (8, 1)]:
                mesh = cluster.logical_mesh(shape)
                c = solver(lg, mesh)
                assert bound / mesh.num_devices <= max(c.forward_peak_bytes, c.backward_peak_bytes) * (1 + 1e-9)
                residual = sum(lg.graph.vars[v].nbytes for v in lg.residuals)
                assert residual / mesh.num_devices <= c.residual_bytes * (1 + 1e-9)


def test_a_layer_on_a_mesh_costs_at_least_its_cost_on_a_scaled_down_mesh_over_the_factor(traced):
    """The planner's bound from smaller meshes (parallel efficiency at most 1) holds for
    the ILP's solutions, including meshes whose first axis crosses hosts, and relates
    only meshes that differ in one axis with links no slower."""
    from autopar.pipeline.planner import scaled_down_meshes

    t, _, _ = traced
    layers = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
    cluster = Cluster.parse("4x2:a100-80g")
    shapes = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)]
    meshes = [(i, 0, cluster.logical_mesh(s)) for i, s in enumerate(shapes)]
    solver = LayerSolver()
    pairs = 0
    for spec in (layers[0], layers[1], layers[-1]):
        lg = trace_layer(t.loss, spec)
        for _, _, big in meshes:
            for i, _, f in scaled_down_meshes(big, meshes):
                small = meshes[i][2]
                assert big.num_devices == f * small.num_devices
                (a, b), (x, y) = big.shape, small.shape
                assert (a == x and b == f * y) or (b == y and a == f * x)
                assert solver(lg, big).time_s * (1 + 1e-9) >= solver(lg, small).time_s / f
                pairs += 1
    assert pairs >= 3 * 8
    # (2, 2) crosses hosts on its first axis: it does not bound (2, 4)-like meshes within a host
    inside = Cluster.parse("1x8:a100-80g").logical_mesh((2, 4))
    assert not any(m.shape == (2, 2) for *_, m in [meshes[j] for j, *_ in scaled_down_meshes(inside, meshes)])


def test_a_layer_costs_per_sample_at_least_what_it_costs_on_micro_batches_a_factor_larger():
    """The planner's bounds across micro-batch counts (`_Candidates._layer_bound`,
    `_scaled_bound`): the same layer's ILP optimum on micro-batches k times smaller is at
    least 1/k of its optimum on the larger ones, on every mesh, in both parameter modes;
    and where every layout of the larger survives the shrinking (`shrinks_evenly`), the
    larger costs at least what the smaller does."""
    opt = optax.adamw(1e-2)
    tracer = StepTracer(make_step(opt, closure=True), (init_state(opt), make_batch(jax.random.PRNGKey(0), 8)))
    cluster = Cluster.parse("2x4:a100-80g")
    solver = LayerSolver()
    by_B = {}
    for B in (1, 2, 4):
        t = tracer.at(B)
        specs = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
        by_B[B] = [trace_layer(t.loss, spec) for spec in (specs[0], specs[1], specs[-1])]
    pairs, even = 0, set()
    for small_B, large_B in ((1, 2), (2, 4), (1, 4)):
        for big, small in zip(by_B[small_B], by_B[large_B]):
            for shape in [(1, 4), (2, 4), (8, 1), (2, 1)]:
                mesh = cluster.logical_mesh(shape)
                for params in ("fast", "sharded"):
                    fewer, more = solver(big, mesh, params).time_s, solver(small, mesh, params).time_s
                    assert more * (1 + 1e-9) >= fewer * small_B / large_B
                    if shrinks_evenly(big, small, shape):
                        assert fewer * (1 + 1e-9) >= more
                        even.add((small_B, large_B, shape))
                    pairs += 1
    assert pairs == 3 * 3 * 4 * 2
    # 8 samples -> 4 or 2 keep every layout of a 2-device mesh; 4 -> 2 loses the 4-way batch split
    assert {(1, 2, (2, 1)), (2, 4, (2, 1)), (1, 4, (2, 1)), (1, 2, (1, 4))} <= even
    assert not even & {(2, 4, (1, 4)), (1, 4, (1, 4)), (2, 4, (2, 4)), (1, 2, (2, 4))}


def test_stage_cost_is_its_layers_plus_the_reshards_between_them(traced):
    """A stage's time is its layers' ILP objectives plus, where one layer hands an
    activation on in another layout than the next takes it, that reshard (both ways)."""
    t, _, _ = traced
    layers = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
    graphs = [trace_layer(t.loss, spec) for spec in layers]
    mesh = Cluster.parse("1x4:a100-80g").logical_mesh((2, 2))
    costs = [solve_layer(lg, mesh) for lg in graphs[:3]]
    stage = stage_layers(graphs[:3], graphs)
    got = compose(stage, costs, mesh, state_bytes_per_param_byte=2.0, send_s_per_byte=0.0)
    want = sum(c.time_s for c in costs)
    for a, (lg, c) in enumerate(zip(graphs[1:3], costs[1:3]), 1):
        src_lg, src_c = graphs[a - 1], costs[a - 1]
        for j, v in enumerate(lg.spec.in_acts):
            if v in src_lg.spec.out_acts:
                k = src_lg.spec.out_acts.index(v)
                have, want_spec = src_c.out_specs[k], c.var_specs[lg.act_vars[j]]
                want += reshard_cost(have, want_spec, lg.graph.vars[lg.act_vars[j]], mesh)[0]
                want += reshard_cost(want_spec, src_c.var_specs[src_lg.ct_vars[k]],
                                     lg.graph.vars[lg.act_vars[j]], mesh)[0]
    shared = {}
    for lg, c in zip(graphs[:3], costs):       # the tied embedding is read by one of these only
        for i, v in zip(lg.spec.param_inputs, lg.param_vars):
            shared.setdefault(i, []).append(c.var_specs[v])
    assert all(len(x) == 1 for x in shared.values())
    assert got.micro_batch_s == pytest.approx(want, rel=1e-12)
    assert got.activation_bytes == pytest.approx(sum(c.residual_bytes for c in costs))
    params = sum(per_device_bytes(lg, c.var_specs, mesh.shape, v)
                 for lg, c in zip(graphs[:3], costs) for v in lg.param_vars)
    assert got.weight_bytes == pytest.approx(params * (1 + 2.0 + 1))   # params, adam moments, accumulators


def test_optimizer_state_is_counted_per_parameter_byte():
    for opt, want in ((optax.sgd(0.1), 0.0), (optax.adamw(1e-3), 2.0)):
        state, batch = init_state(opt), make_batch(jax.random.PRNGKey(0), 4)
        assert optimizer_state_factor(StepTracer(make_step(opt), (state, batch))) == pytest.approx(want, rel=1e-6)


def test_a_method_reuses_its_layer_solutions_across_planning_runs():
    """Layer ILPs depend on layer content and mesh only: planning again with the same
    PipeshardParallel solves none of the layers it solved before (the same request: no
    solve at all; a tighter budget: only the new sharded and remat variants), and each plan
    equals what a fresh method plans."""
    import autopar

    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(0), 8)
    step = make_step(opt)
    kw = dict(num_micro_batches=2, num_stages=2)
    method = autopar.PipeshardParallel(**kw)
    plan = lambda m, **b: autopar.make_plan(step, state, batch, cluster="1x4:a100-80g", method=m, **b)
    first = plan(method)
    repeat = plan(method)
    budget = int(0.8 * max(s.memory_bytes for s in first.stages))
    tight = plan(method, memory_budget=budget)
    fresh = plan(autopar.PipeshardParallel(**kw), memory_budget=budget)
    describe = lambda p: (p.predicted_time_s, [(s.layer_range, s.mesh_shape, s.param_mode, s.remat.mode)
                                               for s in p.stages])
    assert first.pipeline.search.ilp_solves > 0 and repeat.pipeline.search.ilp_solves == 0
    assert describe(repeat) == describe(first)
    assert 0 <= tight.pipeline.search.ilp_solves < fresh.pipeline.search.ilp_solves
    assert describe(tight) == describe(fresh)
    assert method == autopar.PipeshardParallel(**kw)      # the cache is not part of the method's value


def test_more_stages_than_grouped_layers_keep_one_block_per_layer():
    """With more stages than the 16 layers repeated blocks are grouped into, the blocks
    are grouped so that every stage can get one; 20 given identical submeshes are one
    candidate shape for the DP (a 20 x 20 x 1 problem, not 20 x 20 x 20)."""
    import autopar
    from autopar.interface import PlanRequest

    n = 20

    def loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    def step(params, x):
        return jax.grad(loss)(params, x)

    params = [jnp.zeros((16, 16), jnp.float32)] * n
    x = jnp.zeros((8, 16), jnp.float32)
    cluster = Cluster.parse("5x4:a100-80g")
    method = autopar.PipeshardParallel(num_micro_batches=2, submeshes=[(1, 1)] * n)
    planner = method._planner(PlanRequest(fun=step, args=(params, x), kwargs={}, cluster=cluster,
                                          signature="s", remat="none"))
    decision = planner.plan()
    assert len(planner.cut_options()[0]) - 1 >= n
    assert len(planner.problem(2, 0).shapes) == 1
    assert len(decision.stages) == n
    assert max(len(st.layers.layers) for st in decision.stages) <= 2
