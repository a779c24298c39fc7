"""Op graph tracer: structure, FLOPs against closed forms and XLA, and exact re-evaluation."""
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar.graph import OpGraph, call_graph, eval_graph, trace_graph
from rockmate.graph import eval_ops
from rockmate.graph.trace import INLINED

D, LAYERS, SEQ, VOCAB, BATCH = 32, 2, 8, 64, 4


# ---------------------------------------------------------------- helpers


def raw_primitive_names(closed) -> set[str]:
    """Every primitive name in a jaxpr and all its sub-jaxprs (the uninlined reference)."""
    names = set()
    for eqn in closed.jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple) else (v,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= raw_primitive_names(sub)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= raw_primitive_names(jax.extend.core.ClosedJaxpr(sub, ()))
    return names


def assert_well_formed(graph: OpGraph) -> None:
    """SSA: every var defined once, every input defined before use, specs for all ids."""
    defined = set(graph.invars) | set(graph.literals)
    assert not set(graph.invars) & set(graph.literals)
    for i, op in enumerate(graph.ops):
        assert op.index == i
        assert all(v in defined for v in op.inputs), op.name
        assert not defined & set(op.outputs), op.name
        defined |= set(op.outputs)
        if op.body is not None:
            assert_well_formed(op.body)
    assert all(v in defined for v in graph.outvars)
    assert defined <= set(graph.vars)


def assert_close(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def check_reproduces(f, *args, eager=True) -> OpGraph:
    """Trace f; its graph must be well formed, free of call wrappers, and equal f jitted and eagerly.

    Eager runs compile every primitive once (seconds for a train step), so big steps opt out.
    """
    closed = jax.make_jaxpr(f)(*args)
    graph = trace_graph(f, *args)
    assert_well_formed(graph)
    assert not graph.op_names() & INLINED.keys()
    assert len(graph.invars) == len(jax.tree_util.tree_leaves(args))
    expected = jax.jit(f)(*args)
    assert_close(jax.jit(lambda *a: call_graph(graph, *a))(*args), expected)
    if eager:
        assert_close(call_graph(graph, *args), expected)
    graph.raw_names = raw_primitive_names(closed)  # for callers' extra checks
    return graph


# ---------------------------------------------------------------- models


rng = np.random.default_rng(0)  # numpy data: eager jax.random would compile a kernel per call


def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def init_params(model: nn.Module, *example):
    """Random parameters without compiling model.init: shapes from eval_shape, values from numpy."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *example)
    return jax.tree_util.tree_map(lambda s: normal(*s.shape) * 0.2, shapes)


def mlp_train_step():
    opt = optax.adamw(1e-3)
    params = {"w1": normal(16, 64) * 0.1, "b1": jnp.zeros(64), "w2": normal(64, 4) * 0.1, "b2": jnp.zeros(4)}
    batch = {"x": normal(BATCH, 16), "y": jnp.arange(BATCH) % 4}

    def loss_fn(p, b):
        h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], b["y"]).mean()

    def step(state, b):
        p, s = state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        upd, s = opt.update(g, s, p)
        return (optax.apply_updates(p, upd), s), loss

    return step, ((params, jax.jit(opt.init)(params)), batch)


class Block(nn.Module):
    """Pre-LN GPT block; (x, _) -> (x, None) so it can also be an nn.scan body."""

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=D)(h, mask=mask)
        h = nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))
        return x + h, None


class GPT(nn.Module):
    scan: bool

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        if self.scan:
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
            x, _ = stack()(x, None)
        else:
            for _ in range(LAYERS):
                x, _ = Block()(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@functools.cache
def gpt_loss(scan: bool):
    """(loss(params, tokens), params, tokens) of a 2-layer GPT, unrolled or with nn.scan."""
    model = GPT(scan)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    params = init_params(model, tokens)

    def loss(p, t):
        logits = model.apply(p, t[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    return loss, params, tokens


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2, feature_group_count=2)(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


# ---------------------------------------------------------------- reproduction


def test_mlp_adamw_train_step_reproduces():
    step, args = mlp_train_step()
    graph = check_reproduces(step, *args)
    assert graph.raw_names & INLINED.keys(), "reference should contain jit/custom_jvp calls"
    assert graph.out_tree == jax.tree_util.tree_structure(step(*args))


@pytest.mark.parametrize("scan", [False, True])
def test_gpt_forward_inlines_calls_and_keeps_scan(scan):
    loss, params, tokens = gpt_loss(scan)
    graph = check_reproduces(loss, params, tokens, eager=scan)  # eager compiles op by op: keep it short
    assert graph.raw_names & INLINED.keys()
    scans = [op for op in graph.ops if op.name == "scan"]
    if scan:
        assert len(scans) == 1 and scans[0].trip_count == LAYERS and scans[0].body is not None
        body = scans[0].body
        assert "dot_general" in body.op_names() and not body.op_names() & INLINED.keys()
        assert scans[0].flops == pytest.approx(body.total_flops * LAYERS)
    else:
        assert not scans


def test_scanned_gpt_value_and_grad_reproduces():
    loss, params, tokens = gpt_loss(True)
    graph = check_reproduces(jax.value_and_grad(loss), params, tokens, eager=False)
    scans = [op for op in graph.ops if op.name == "scan"]
    assert len(scans) == 2 and all(op.trip_count == LAYERS for op in scans)  # forward and backward


def test_embedding_cross_entropy_reproduces():
    table = normal(VOCAB, D)
    ids = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)

    def loss(table, ids):
        logits = table[ids] @ table.T
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

    graph = check_reproduces(jax.value_and_grad(loss), table, ids)
    assert {"gather", "scatter-add"} <= graph.op_names()


def test_conv_net_train_step_reproduces_and_counts_conv_flops():
    model = ConvNet()
    x = normal(2, 12, 12, 4)
    y = jnp.array([1, 7])
    params = init_params(model, x)

    def step(p, x, y):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), value

    graph = check_reproduces(step, params, x, y, eager=False)
    assert len([op for op in graph.ops if op.name == "conv_general_dilated"]) == 2 + 3  # fwd, dx, dw
    fwd = trace_graph(model.apply, params, x)
    convs = [op for op in fwd.ops if op.name == "conv_general_dilated"]
    # closed form: 2 x output elements x kernel spatial x input features per group
    assert [op.flops for op in convs] == [2 * (2 * 12 * 12 * 8) * (3 * 3 * 4),
                                         2 * (2 * 6 * 6 * 16) * (3 * 3 * 8 // 2)]


# ---------------------------------------------------------------- FLOPs and bytes


@pytest.mark.parametrize("m,k,n", [(8, 16, 4), (3, 5, 7), (1, 128, 64)])
def test_matmul_flops_closed_form_and_xla(m, k, n):
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    graph = trace_graph(jnp.matmul, a, b)
    (op,) = graph.ops
    assert op.name == "dot_general" and op.flops == 2 * m * n * k
    assert op.bytes_accessed == 4 * (m * k + k * n + m * n)
    xla = jax.jit(jnp.matmul).lower(a, b).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert op.flops == xla["flops"]


def test_batched_dot_flops_and_elementwise_and_reduction():
    q, k = jax.ShapeDtypeStruct((2, 3, 8, 16), jnp.float32), jax.ShapeDtypeStruct((2, 3, 8, 16), jnp.float32)
    graph = trace_graph(lambda q, k: jnp.exp(jnp.einsum("bhqd,bhkd->bhqk", q, k)).sum(), q, k)
    flops = {op.name: op.flops for op in graph.ops}
    assert flops["dot_general"] == 2 * (2 * 3) * 8 * 8 * 16
    assert flops["exp"] == 2 * 3 * 8 * 8
    assert flops["reduce_sum"] == 2 * 3 * 8 * 8
    assert graph.total_flops == sum(flops.values())


@pytest.mark.parametrize("grad", [False, True])
def test_scanned_stack_flops_equal_unrolled_stack(grad):
    out = {}
    for scan in (False, True):
        loss, params, tokens = gpt_loss(scan)
        out[scan] = trace_graph(jax.value_and_grad(loss) if grad else loss, params, tokens).flops_by_name()
    assert out[True]["dot_general"] == out[False]["dot_general"] > 0
    assert out[True]["exp"] == out[False]["exp"]
    total = {s: sum(v.values()) for s, v in out.items()}
    assert total[True] == pytest.approx(total[False], rel=1e-3)


def test_while_and_cond_are_single_ops_costed_once():
    w = jnp.ones((8, 8))

    def f(x, p, n):
        x = jax.lax.cond(p, lambda x: x @ w, lambda x: x + 1.0, x)
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))

    graph = check_reproduces(f, jnp.ones((4, 8)), True, 3)
    by_name = {op.name: op for op in graph.ops}
    assert by_name["cond"].flops == 2 * 4 * 8 * 8  # the costlier branch
    # body once (add, dot, tanh) plus the test (lt)
    assert by_name["while"].flops == 1 + 2 * 4 * 8 * 8 + 4 * 8 + 1
    assert by_name["while"].body is None


# ---------------------------------------------------------------- literals, constants, pytrees


def test_literals_and_closed_over_constants():
    const = np.arange(12, dtype=np.float32).reshape(3, 4)

    def f(x):
        return (x * 2.0 + const) @ jnp.asarray(const).T, x.sum() + 3

    x = jnp.linspace(-1, 1, 12).reshape(3, 4)
    graph = check_reproduces(f, x)
    values = [np.asarray(v) for v in graph.literals.values()]
    assert any(v.shape == (3, 4) and np.array_equal(v, const) for v in values)
    assert any(v.shape == () and float(v) == 2.0 for v in values)
    for vid, v in graph.literals.items():
        assert graph.vars[vid].shape == np.shape(v)


def test_output_can_be_input_or_literal_and_drop_vars_are_numbered():
    def f(x):
        _, idx = jax.lax.top_k(x, 2)  # the values output is dropped
        return x, 1.0, idx

    graph = check_reproduces(f, jnp.array([3.0, 1.0, 2.0]))
    assert graph.outvars[0] == graph.invars[0]
    assert graph.outvars[1] in graph.literals
    (top_k,) = [op for op in graph.ops if op.name == "top_k"]
    assert len(set(top_k.outputs)) == 2 and all(v in graph.vars for v in top_k.outputs)


def test_pytree_round_trip_with_kwargs_and_shape_dtype_structs():
    def f(a, b, *, scale):
        return {"sum": a["u"] + b[0], "pair": (b[1] * scale, a["v"])}

    a = {"u": jnp.ones(3), "v": jnp.zeros((2,), jnp.int32)}
    b = (jnp.arange(3.0), jnp.ones((2, 2), jnp.bfloat16))
    abstract = jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), (a, b))
    graph = trace_graph(f, *abstract, scale=jax.ShapeDtypeStruct((), jnp.bfloat16))
    scale = jnp.bfloat16(3)
    assert graph.in_tree == jax.tree_util.tree_structure(((a, b), {"scale": scale}))
    assert [graph.vars[v].dtype for v in graph.invars] == ["float32", "int32", "float32", "bfloat16", "bfloat16"]
    assert_close(call_graph(graph, a, b, scale=scale), f(a, b, scale=scale))
    with pytest.raises(ValueError, match="structure"):
        call_graph(graph, a, b)
    with pytest.raises(ValueError, match="flat arguments"):
        eval_graph(graph, [1.0])
    with pytest.raises(TypeError, match="functools.partial"):
        trace_graph(lambda x, s: x, jnp.ones(2), "relu")


def test_on_output_hook_sees_every_output_and_can_replace_it():
    graph = trace_graph(lambda x: jnp.tanh(x) * 2.0, jnp.ones(4))
    seen = []

    def hook(op, vid, value):
        seen.append((op.name, vid))
        return value + 1.0 if op.name == "tanh" else value

    (out,) = eval_graph(graph, [jnp.zeros(4)], on_output=hook)
    assert seen == [(op.name, op.outputs[0]) for op in graph.ops]
    np.testing.assert_array_equal(out, jnp.full(4, 2.0))


def test_on_output_hook_places_sharding_constraints_under_jit():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    f = lambda x, w: jnp.tanh(x @ w).sum()
    x, w = jnp.ones((16, 8)), jnp.ones((8, 8))
    graph = trace_graph(f, x, w)

    def hook(op, vid, value):
        return jax.lax.with_sharding_constraint(value, sharding) if op.name == "dot_general" else value

    run = jax.jit(lambda x, w: eval_graph(graph, [x, w], on_output=hook)[0])
    assert "sharding_constraint" in run.lower(x, w).as_text()
    np.testing.assert_allclose(run(x, w), f(x, w), rtol=1e-6)


# ---------------------------------------------------------------- scale


def test_ten_thousand_equation_chain_traces_and_reproduces():
    layers = 2500
    ws = jnp.full((layers, 4, 4), 0.1)

    def chain(x, ws):
        for i in range(layers):  # 4 equations a layer: slice, squeeze, dot_general, tanh
            x = jnp.tanh(x @ ws[i])
        return x

    closed = jax.make_jaxpr(chain)(jnp.ones((2, 4)), ws)
    assert len(closed.jaxpr.eqns) == 4 * layers
    start = time.perf_counter()
    graph = trace_graph(chain, jnp.ones((2, 4)), ws)
    assert time.perf_counter() - start < 30  # sanity only; the target lives in benchmarks/graph_trace.py
    assert len(graph.ops) == 4 * layers
    assert graph.flops_by_name()["dot_general"] == layers * 2 * 2 * 4 * 4
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    assert_close(eval_graph(graph, [x, ws]), jax.tree_util.tree_leaves(chain(x, ws)))


def test_kept_custom_rules_stay_one_op_and_their_gradient_rule_still_applies():
    """A graph that is differentiated after tracing keeps custom_vjp/custom_jvp calls whole:
    inlining the primal body would give the body's derivative, not the rule's."""
    @jax.custom_vjp
    def clipped_identity(x):
        return x

    clipped_identity.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))

    def f(x):
        return jnp.sum(jax.nn.softmax(jax.nn.relu(clipped_identity(x) * 3.0)) * jnp.arange(8.0))

    x = jnp.linspace(-1.0, 1.0, 8)
    kept = trace_graph(f, x, keep_custom_rules=True)
    inlined = trace_graph(f, x)
    assert {"custom_vjp_call", "custom_jvp_call"} <= {op.name for op in kept.ops}
    assert not {"custom_vjp_call", "custom_jvp_call"} & {op.name for op in inlined.ops}
    custom = next(op for op in kept.ops if op.name == "custom_vjp_call")
    assert custom.body is not None and custom.flops == custom.body.total_flops
    want = jax.grad(f)(x)
    got = jax.grad(lambda x: call_graph(kept, x))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the inlined body differentiates the identity: a different (unclipped) gradient
    assert not np.allclose(jax.grad(lambda x: call_graph(inlined, x))(x), want)


# ---------------------------------------------------------------- marks and op ranges


def test_marked_jit_calls_tag_their_ops_with_the_outermost_occurrence():
    def marked(fn, name):
        fn.__name__ = name
        return jax.jit(fn)

    inner = marked(lambda h: jnp.sin(h) * 2.0, "blk_inner")  # marked, but inside another marked call
    layer = marked(lambda w, h: inner(h @ w) + h, "blk_layer")
    helper = jax.jit(lambda h: jnp.tanh(h))                   # an unmarked jit: inlined, no mark

    def f(ws, x):
        h = helper(x)
        for w in ws:
            h = layer(w, h)
        return jnp.sum(h)

    ws, x = [normal(4, 4) for _ in range(3)], normal(2, 4)
    graph = trace_graph(f, ws, x, mark_calls="blk")
    layer_ops = 4  # dot_general, sin, mul, add
    assert [op.mark for op in graph.ops] == [None] + [m for m in (1, 2, 3) for _ in range(layer_ops)] + [None]
    assert all(op.mark is None for op in trace_graph(f, ws, x).ops)


def test_eval_ops_runs_a_graph_range_by_range():
    loss, params, tokens = gpt_loss(False)
    graph = trace_graph(jax.value_and_grad(loss), params, tokens, keep_custom_rules=True)
    cuts = [0, 7, len(graph.ops) // 2, len(graph.ops)]

    def piecewise(p, t):
        env = dict(zip(graph.invars, jax.tree_util.tree_leaves((p, t))))
        for a, b in zip(cuts[:-1], cuts[1:]):
            eval_ops(graph, env, range(a, b))
        return jax.tree_util.tree_unflatten(graph.out_tree, [env.get(v, graph.literals.get(v)) for v in graph.outvars])

    assert_close(jax.jit(piecewise)(params, tokens), jax.jit(jax.value_and_grad(loss))(params, tokens))
