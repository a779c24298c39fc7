"""The intra-op ILP: exact against brute force, and equal to closed-form costs on textbook plans."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar import assignment_ilp as ilp
from rockmate.graph.trace import trace_graph
from autopar.intra_op import build_problem, plan_sharding
from rockmate.repeats import representatives, tandem_repeats
from autopar.resharding import reshard_cost
from autopar.sharding_spec import all_layouts
from autopar.strategies import enumerate_strategies


def _random_problem(rng, with_ties):
    nn = int(rng.integers(2, 7))
    nch = [int(rng.integers(1, 4)) for _ in range(nn)]
    tie = list(range(nn))
    if with_ties:
        for k in range(1, nn):
            j = int(rng.integers(0, k))
            if rng.random() < 0.4 and tie[j] == j:
                tie[k], nch[k] = j, nch[j]
    edges = []
    for _ in range(int(rng.integers(1, 8))):
        a, b = rng.choice(nn, 2, replace=False)
        ka, kb = rng.integers(0, 2, nch[a]), rng.integers(0, 3, nch[b])
        edges.append(ilp.Edge(int(a), int(b), ka, kb, rng.random((ka.max() + 1, kb.max() + 1))))
    rows = [ilp.MemoryRow({k: rng.random(nch[k]) for k in range(nn)})]
    return ilp.AssignmentProblem([rng.random(c) for c in nch], edges, rows, rng.uniform(0.3 * nn, 0.6 * nn), tuple(tie))


@pytest.mark.parametrize("solver", ["highs", "cbc"])
@pytest.mark.parametrize("with_ties", [False, True])
def test_assignment_ilp_equals_brute_force(solver, with_ties):
    rng = np.random.default_rng(7 + with_ties)
    for _ in range(15):
        p = _random_problem(rng, with_ties)
        best = ilp.brute_force(p)
        if best is None:
            with pytest.raises(ilp.InfeasibleError):
                ilp.solve(p, 10, solver)
            continue
        got = ilp.solve(p, 10, solver)
        assert got.objective_s == pytest.approx(best[1], rel=1e-9, abs=1e-12)
        assert all(m <= p.memory_limit_bytes * (1 + 1e-9) for m in ilp.memory_of(p, got.choice))
        assert all(got.choice[k] == got.choice[p.rep(k)] for k in range(len(p.node_cost_s)))


def test_eliminating_chains_and_leaves_keeps_the_optimum_and_shrinks_the_ilp():
    """Without a memory limit, leaves and chains are solved out before HiGHS sees the problem
    (`assignment_ilp.eliminate`): the optimum equals brute force on random graphs with
    cycles and ties, a tree leaves no variable at all, and nodes in memory rows are kept."""
    rng = np.random.default_rng(11)
    shrunk = 0
    for trial in range(25):
        p = _random_problem(rng, with_ties=trial % 2 == 1)
        free = ilp.AssignmentProblem(p.node_cost_s, p.edges, [], float("inf"), p.tie)
        best = ilp.brute_force(free)
        got = ilp.solve(free, 10)
        assert got.objective_s == pytest.approx(best[1], rel=1e-9, abs=1e-12)
        assert all(got.choice[k] == got.choice[free.rep(k)] for k in range(len(free.node_cost_s)))
        full, _ = ilp._build(free, reduce=False)
        shrunk += got.num_variables < len(full.c)
        # with the memory rows every node stays, and the solution still respects them
        bounded = ilp.solve(p, 10) if ilp.brute_force(p) is not None else None
        if bounded is not None:
            assert bounded.objective_s == pytest.approx(ilp.brute_force(p)[1], rel=1e-9, abs=1e-12)
    assert shrunk >= 20
    # a chain with a leaf hanging off it: a tree, solved without any LP variable
    n = 7
    costs = [rng.random(4) for _ in range(n)]
    links = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (2, 6)]
    edges = [ilp.Edge(a, b, np.arange(4), np.arange(4), rng.random((4, 4))) for a, b in links]
    tree = ilp.AssignmentProblem(costs, edges)
    got = ilp.solve(tree, 10)
    assert got.num_variables == 0
    assert got.objective_s == pytest.approx(ilp.brute_force(tree)[1], rel=1e-12)


def test_graph_ilp_equals_brute_force_over_all_strategy_combinations():
    """A 3-op graph on a 1x4 mesh: enumerate every input layout and every op strategy."""
    def f(x, w1, w2):
        return jnp.sum((x @ w1) @ w2)

    args = (jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((8, 32), jnp.float32),
            jax.ShapeDtypeStruct((32, 4), jnp.float32))
    graph = trace_graph(f, *args)
    assert len(graph.ops) <= 6
    mesh = autopar.Cluster.preset("a100-80g", 1, 4).logical_mesh((1, 4))
    built = build_problem(graph, mesh, tie_layers=False)
    solved = ilp.solve(built.problem, 30, "highs")

    choices = [all_layouts(graph.vars[v].shape, mesh.shape) for v in graph.invars]
    choices += [enumerate_strategies(op, graph, mesh) for op in graph.ops]
    producer_spec = {}
    best = np.inf
    for combo in itertools.product(*choices):
        lay, strats = combo[:len(graph.invars)], combo[len(graph.invars):]
        producer_spec = dict(zip(graph.invars, lay))
        cost = 0.0
        for op, s in zip(graph.ops, strats):
            cost += s.compute_s + s.comm_s
            for v, need in zip(op.inputs, s.in_specs):
                if v in graph.literals:
                    continue
                cost += reshard_cost(producer_spec[v], need, graph.vars[v], mesh)[0]
            producer_spec.update(zip(op.outputs, s.out_specs))
        best = min(best, cost)
    assert solved.objective_s == pytest.approx(best, rel=1e-9)


def _mlp_grad_graph(B, D, H, O):
    def loss(w1, w2, x, y):
        return jnp.mean((jax.nn.relu(x @ w1) @ w2 - y) ** 2)

    def grads(w1, w2, x, y):
        return jax.grad(loss, argnums=(0, 1))(w1, w2, x, y)

    sds = jax.ShapeDtypeStruct
    return trace_graph(grads, sds((D, H), jnp.float32), sds((H, O), jnp.float32), sds((B, D), jnp.float32),
                       sds((B, O), jnp.float32))


def test_data_parallel_objective_equals_closed_form_gradient_all_reduce():
    B, D, H, O = 2048, 64, 64, 64
    graph = _mlp_grad_graph(B, D, H, O)
    mesh = autopar.Cluster.preset("a100-80g", 1, 8).logical_mesh((1, 8))
    w1, w2, x, y = graph.invars
    fixed = {w1: ((), ()), w2: ((), ()), x: ((1,), ()), y: ((1,), ())}
    plan = plan_sharding(graph, mesh, fixed_specs=fixed, tie_outputs={0: 0, 1: 1})
    closed_form = mesh.all_reduce_s(D * H * 4, 1) + mesh.all_reduce_s(H * O * 4, 1)
    assert plan.comm_s + plan.reshard_s == pytest.approx(closed_form, rel=1e-6)
    assert sorted(c.nbytes for c in plan.collectives if c.kind == "all-reduce") == sorted([D * H * 4, H * O * 4])


def test_megatron_objective_equals_closed_form_one_all_reduce():
    B, D, H, O = 64, 256, 1024, 256
    graph = _mlp_grad_graph(B, D, H, O)
    mesh = autopar.Cluster.preset("a100-80g", 1, 8).logical_mesh((1, 8))
    w1, w2, x, y = graph.invars
    fixed = {w1: ((), (1,)), w2: ((1,), ()), x: ((), ()), y: ((), ())}   # column- then row-parallel
    plan = plan_sharding(graph, mesh, fixed_specs=fixed, tie_outputs={0: 0, 1: 1})
    assert plan.comm_s + plan.reshard_s == pytest.approx(mesh.all_reduce_s(B * O * 4, 1), rel=1e-6)
    assert [c.kind for c in plan.collectives if c.nbytes > 64] == ["all-reduce"]


def test_auto_is_never_worse_than_the_baselines_it_generalises():
    graph = _mlp_grad_graph(256, 128, 512, 128)
    mesh = autopar.Cluster.preset("a100-80g", 1, 8).logical_mesh((1, 8))
    w1, w2, x, y = graph.invars
    auto = plan_sharding(graph, mesh)
    dp = plan_sharding(graph, mesh, fixed_specs={w1: ((), ()), w2: ((), ()), x: ((1,), ()), y: ((1,), ())})
    mg = plan_sharding(graph, mesh, fixed_specs={w1: ((), (1,)), w2: ((1,), ()), x: ((), ()), y: ((), ())})
    assert auto.objective_s <= min(dp.objective_s, mg.objective_s) * (1 + 1e-9)


def test_tandem_repeats_are_real_and_find_planted_layers():
    rng = np.random.default_rng(0)
    for _ in range(30):
        layer = list(rng.integers(0, 5, int(rng.integers(4, 12))))
        copies = int(rng.integers(2, 7))
        pre, post = list(rng.integers(5, 9, 3)), list(rng.integers(5, 9, 4))
        seq = pre + layer * copies + post
        reps = tandem_repeats(seq)
        taken = set()
        for a, m, k in reps:
            assert k >= 2 and m >= 4
            assert all(seq[i] == seq[i + m] for i in range(a, a + m * (k - 1)))
            span = set(range(a, a + m * k))
            assert not span & taken
            taken |= span
        rep = representatives(len(seq), reps)
        assert all(seq[i] == seq[rep[i]] for i in range(len(seq)))
        tied = sum(1 for i, r in enumerate(rep) if r != i)
        assert tied >= len(layer) * (copies - 1) - len(layer)  # at most one copy lost to a shifted period


def test_tied_layers_shrink_the_ilp_and_keep_layers_identical():
    from autopar.model_zoo import GPTConfig, gpt_abstract_setup
    from autopar.planner import state_ties

    cfg = GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=4, batch=8)
    step, state, batch = gpt_abstract_setup(cfg)
    graph = trace_graph(step, state, batch)
    mesh = autopar.Cluster.preset("a100-80g", 1, 8).logical_mesh((1, 8))
    ties = state_ties(graph, (state, batch), (1,))
    tied = build_problem(graph, mesh, tie_outputs=ties)
    untied = build_problem(graph, mesh, tie_outputs=ties, tie_layers=False)
    assert sum(1 for k, t in enumerate(tied.problem.tie) if t != k) > len(tied.groups) // 2
    m_tied, _ = ilp._build(tied.problem)
    m_untied, _ = ilp._build(untied.problem)
    assert len(m_tied.c) < 0.7 * len(m_untied.c)
    a = ilp.solve(tied.problem, 60)
    b = ilp.solve(untied.problem, 60)
    assert a.objective_s >= b.objective_s * (1 - 1e-9)          # a restriction can only cost more
    assert a.objective_s <= b.objective_s * 1.05                 # ... and identical layers lose little


def test_a_planning_runs_memo_answers_as_the_pure_functions_do():
    """ShardingCosts (one per planning run) returns each op's strategies and each reshard
    cost exactly as computed afresh, answers repeated layers from the memo, and a plan made
    through a used memo equals one made with a fresh memo."""
    from autopar.model_zoo import GPTConfig, gpt_abstract_setup
    from autopar.sharding_costs import ShardingCosts

    step, state, batch = gpt_abstract_setup(GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=3, batch=8))
    graph = trace_graph(step, state, batch)
    mesh = autopar.Cluster.preset("a100-80g", 1, 8).logical_mesh((2, 4))
    costs = ShardingCosts()
    for op in graph.ops:
        assert costs.strategies(op, graph, mesh) == enumerate_strategies(op, graph, mesh)
    assert len(costs._strategies) < len(graph.ops) // 2          # the three layers share entries
    first = plan_sharding(graph, mesh, costs=costs)
    assert costs._reshards
    for (src, dst, shape, dtype, _), hit in list(costs._reshards.items())[:200]:
        spec = next(graph.vars[v] for v in graph.vars if graph.vars[v].shape == shape and graph.vars[v].dtype == dtype)
        assert hit == reshard_cost(src, dst, spec, mesh)
    # reshard matrices and fused strategies, memoised across the run's ILPs
    assert costs._matrices and costs._fused
    for (src, dst, shape, dtype, _), matrix in list(costs._matrices.items())[:20]:
        spec = next(graph.vars[v] for v in graph.vars if graph.vars[v].shape == shape and graph.vars[v].dtype == dtype)
        assert matrix.tolist() == [[reshard_cost(a, b, spec, mesh)[0] for b in dst] for a in src]
    for op in graph.ops[:60]:
        counted = tuple(i % 2 == 0 for i in range(len(op.inputs) + len(op.outputs)))
        assert costs.strategies(op, graph, mesh, counted) == [
            s.fused(counted, mesh.memory_s) for s in enumerate_strategies(op, graph, mesh)]
    again = plan_sharding(graph, mesh, costs=costs)
    fresh = plan_sharding(graph, mesh)
    assert first.var_specs == again.var_specs == fresh.var_specs
    assert first.objective_s == again.objective_s == fresh.objective_s
