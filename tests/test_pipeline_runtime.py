"""A tiny GPT and its train step for the pipeline tests (pure JAX, sgd and adam)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from autopar.boundary import mark_stage_boundary
from autopar.pipeline.grad import value_and_grad

D, SEQ, VOCAB, HEADS, LAYERS = 32, 8, 64, 2, 4


def init_params(key, layers=LAYERS):
    keys = jax.random.split(key, 2 + layers)
    n = lambda k, shape: 0.1 * jax.random.normal(k, shape, jnp.float32)
    blocks = []
    for i in range(layers):
        k = jax.random.split(keys[2 + i], 4)
        blocks.append({"ln1": jnp.ones(D), "qkv": n(k[0], (D, 3 * D)), "proj": n(k[1], (D, D)),
                       "ln2": jnp.ones(D), "fc1": n(k[2], (D, 4 * D)), "fc2": n(k[3], (4 * D, D))})
    return {"embed": n(keys[0], (VOCAB, D)), "pos": n(keys[1], (SEQ, D)), "blocks": blocks,
            "ln_f": jnp.ones(D)}


def _ln(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return g * (x - mu) / jnp.sqrt(var + 1e-5)


def _block(p, x):
    b, t, _ = x.shape
    h = _ln(x, p["ln1"]) @ p["qkv"]
    q, k, v = jnp.split(h.reshape(b, t, 3, HEADS, D // HEADS), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    att = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(D // HEADS)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v).reshape(b, t, D)
    x = x + y @ p["proj"]
    return x + jax.nn.gelu(_ln(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def loss_fn(params, batch, markers=False):
    tokens, targets = batch["tokens"], batch["targets"]
    x = params["embed"][tokens] + params["pos"]
    for p in params["blocks"]:
        x = _block(p, x)
        if markers:
            x = mark_stage_boundary(x)
    logits = _ln(x, params["ln_f"]) @ params["embed"].T     # tied embedding
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


def make_batch(key, batch_size):
    k1, k2 = jax.random.split(key)
    return {"tokens": jax.random.randint(k1, (batch_size, SEQ), 0, VOCAB),
            "targets": jax.random.randint(k2, (batch_size, SEQ), 0, VOCAB)}


def make_step(optimizer, markers=False):
    def step(state, batch):
        params, opt_state = state
        loss, grads = value_and_grad(lambda p, b: loss_fn(p, b, markers))(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def init_state(optimizer, key=jax.random.PRNGKey(0)):
    params = init_params(key)
    return params, optimizer.init(params)


# ----------------------------------------------------------------------------- tests
import numpy as np
import pytest

from autopar.pipeline.api import build_pipeshard
from autopar.pipeline.method import PipeshardParallel

MICRO = 2                      # micro-batch size is fixed so stage programs are shared
# Test-only: XLA's CPU backend at -O0 compiles these programs about twice as fast; the
# numerics stay float32 (the reference is compiled the same way).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_REFERENCE: dict = {}


def build(step, args, method):
    return build_pipeshard(step, args, method, compiler_options=FAST)


def _reference(optimizer_name, optimizer, state, batch, markers):
    key = (optimizer_name, batch["tokens"].shape[0], markers)
    if key not in _REFERENCE:
        dev0 = jax.devices()[0]
        args = jax.device_put((state, batch), dev0)
        _REFERENCE[key] = jax.jit(make_step(optimizer, markers)).lower(*args).compile(FAST)(*args)
    return _REFERENCE[key]


def _assert_close(got, want, rtol=1e-4, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gpt_matches_single_device(num_stages, schedule):
    """Loss and sgd-updated parameters equal one device for 1, 2 and 4 micro-batches;
    1F1B keeps at most S micro-batches alive on the first stage, GPipe keeps B."""
    opt = optax.sgd(0.1)
    state = init_state(opt)
    for B in (1, 2, 4):
        batch = make_batch(jax.random.PRNGKey(B), MICRO * B)
        method = PipeshardParallel(num_micro_batches=B, schedule=schedule, num_stages=num_stages)
        ex = build(make_step(opt, markers=True), (state, batch), method)
        assert len(ex.plan.stage_layers) == num_stages
        new_state, loss = ex(state, batch)
        ref_state, ref_loss = _reference("sgd", opt, state, batch, True)
        _assert_close(loss, ref_loss)
        _assert_close(new_state, ref_state)
        peak_first = ex.last_run.peak_live_micro_batches[0]
        assert peak_first == (min(num_stages, B) if schedule == "1f1b" else B)
        assert max(ex.last_run.peak_live_micro_batches) <= (num_stages if schedule == "1f1b" else B)


def test_each_stage_program_runs_only_on_its_submesh():
    """Every compiled program of a stage (forward, backward, update) is partitioned over
    exactly that stage's submesh devices, and the submeshes do not overlap."""
    opt = optax.sgd(0.1)
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(2), MICRO * 2)
    ex = build(make_step(opt, markers=True), (state, batch),
                         PipeshardParallel(num_micro_batches=2, num_stages=4))
    ex(state, batch)
    seen = set()
    all_devices = jax.devices()
    for s, programs in enumerate(ex.stage_programs()):
        want = {all_devices[i] for i in ex.plan.device_ids[s]}
        assert not (want & seen)
        seen |= want
        assert set(programs) == {"forward", "backward", "update"}
        for name, compiled in programs.items():
            shardings = jax.tree.leaves(compiled.input_shardings) + jax.tree.leaves(compiled.output_shardings)
            used = set().union(*(sh.device_set for sh in shardings))
            assert used == want, (s, name)
            assert f"num_partitions={len(want)}" in compiled.as_text() or len(want) == 1
    assert ex.stages == [p["backward"] for p in ex.stage_programs()]
    assert ex.as_text().count("// stage") == 3 * 4 and len(ex.memory_analysis()) == 4


def test_adam_with_layer_clustering_matches_single_device():
    """Without markers the layers come from clustering the traced loss; the Adam update
    is split per stage (its moments live with their parameters)."""
    opt = optax.adam(1e-2)
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(3), MICRO * 2)
    ex = build(make_step(opt), (state, batch),
                         PipeshardParallel(num_micro_batches=2, num_stages=2))
    assert ex.split.updates is not None
    (params, opt_state), loss = ex(state, batch)
    (ref_params, ref_opt), ref_loss = _reference("adam", opt, state, batch, False)
    _assert_close(loss, ref_loss)
    _assert_close(opt_state[0].mu, ref_opt[0].mu)                     # = gradient moments
    _assert_close(params, ref_params, atol=2 * 1e-2 + 1e-6)           # adam: see JAX_NOTES
    # the state fed back in keeps working (arrays already on their stages)
    (params2, _), loss2 = ex((params, opt_state), batch)
    assert np.isfinite(float(loss2)) and float(loss2) < float(loss)


def test_unsplittable_update_falls_back_to_one_program():
    """Global-norm clipping mixes every stage's gradients: the update runs as one program
    over all pipeline devices and still matches one device."""
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(2), MICRO * 2)
    ex = build(make_step(opt, markers=True), (state, batch),
                         PipeshardParallel(num_micro_batches=2, num_stages=2))
    assert ex.split.updates is None
    new_state, loss = ex(state, batch)
    ref_state, ref_loss = _reference("clip", opt, state, batch, True)
    _assert_close(loss, ref_loss)
    _assert_close(new_state, ref_state)


def test_clear_errors():
    opt = optax.sgd(0.1)
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(0), 6)

    def plain_step(state, batch):
        return jax.grad(loss_fn)(state[0], batch)

    with pytest.raises(ValueError, match="autopar.value_and_grad"):
        build_pipeshard(plain_step, (state, batch), PipeshardParallel(num_micro_batches=2))
    with pytest.raises(ValueError, match="not divisible by num_micro_batches=4"):
        build_pipeshard(make_step(opt), (state, batch), PipeshardParallel(num_micro_batches=4))
    with pytest.raises(ValueError, match="schedule"):
        PipeshardParallel(num_micro_batches=2, schedule="interleaved")
    ex = build(make_step(opt, markers=True), (state, make_batch(jax.random.PRNGKey(0), MICRO * 2)),
               PipeshardParallel(num_micro_batches=2, num_stages=2))
    with pytest.raises(ValueError, match="plan again"):
        ex(state, make_batch(jax.random.PRNGKey(0), MICRO * 4))


def test_mark_stage_boundary_is_identity_outside_a_pipeline():
    from autopar.boundary import mark_stage_boundary

    def f(x, marked):
        y = jnp.sin(x) * x
        if marked:
            mark_stage_boundary()
            y = mark_stage_boundary(y)
        return jnp.sum(jnp.tanh(y) ** 2)

    x = jnp.linspace(-2.0, 2.0, 16)
    f_marked = jax.jit(jax.value_and_grad(lambda x: f(x, True)))
    np.testing.assert_allclose(f_marked(x)[0], f(x, False), rtol=1e-6)
    np.testing.assert_allclose(f_marked(x)[1], jax.grad(lambda x: f(x, False))(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(lambda v: mark_stage_boundary(v * 2))(x), x * 2)
    assert "autopar_stage_boundary" not in f_marked.lower(x).compile().as_text()


def test_plan_dict_is_json_and_describes_the_pipeline():
    import json

    opt = optax.sgd(0.1)
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(2), MICRO * 2)
    ex = build(make_step(opt, markers=True), (state, batch),
               PipeshardParallel(num_micro_batches=2, num_stages=4, schedule="gpipe"))
    d = json.loads(json.dumps(ex.plan_dict()))
    assert d["num_stages"] == 4 and d["num_micro_batches"] == 2 and d["schedule"] == "gpipe"
    assert [s["device_ids"] for s in d["stages"]] == [list(i) for i in ex.plan.device_ids]
    eq = [s["equations"] for s in d["stages"]]
    assert eq[0][0] == 0 and eq[-1][1] == len(ex.traced.loss_jaxpr.jaxpr.eqns)
    assert all(a[1] == b[0] for a, b in zip(eq, eq[1:]))
    assert len(d["timeline"]) == 2 * 4 * 2
    assert d["predicted_step_s"] == d["predicted_latency_s"] > 0


def _two_stage_loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    h = mark_stage_boundary(h)
    return jnp.mean((h @ p["w2"]) ** 2)


def _two_stage_step(p, x):
    """A two-layer step cut by hand, with a plain sgd update."""
    l, g = value_and_grad(_two_stage_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l


class _MemoryDB:
    """Stands in for autopar.TuningDB's profile table."""

    def __init__(self):
        self.rows = {}

    def get_profile(self, kind, key):
        return self.rows.get((kind, key))

    def put_profile(self, kind, key, value):
        self.rows[(kind, key)] = dict(value)


def test_profile_measures_candidate_stages_once_and_caches_them():
    """profile=True times every candidate stage on the devices; a second plan reads the
    cache; and the plan follows the measurements (here edited to make one cut best)."""
    from autopar.pipeline.profile import PROFILE_KIND

    step = _two_stage_step

    p = {"w1": jnp.full((8, 8), 0.1), "w2": jnp.full((8, 4), 0.2)}
    x = jnp.ones((4, 8))
    devices = jax.devices()[:2]
    db = _MemoryDB()
    method = PipeshardParallel(num_micro_batches=2, profile=True)
    ex = build_pipeshard(step, (p, x), method, devices=devices, tuning_db=db, compiler_options=FAST)
    # 2 layers -> 3 ranges; submeshes (1,1) [1 view] and (1,2) [2 views]
    assert len(db.rows) == 3 * 3
    assert all(v["micro_batch_s"] > 0 and v["activation_bytes"] > 0 for v in db.rows.values())
    (new_p, l) = ex(p, x)
    ref_p, ref_l = jax.jit(step)(p, x)
    _assert_close(l, ref_l)
    _assert_close(new_p, ref_p)
    # make the two-stage split on one device each far cheaper than anything else
    for (kind, key), v in db.rows.items():
        v["micro_batch_s"] = 1.0 if key.endswith("/1x1/1x1") else 100.0
    ex2 = build_pipeshard(step, (p, x), method, devices=devices, tuning_db=db, compiler_options=FAST)
    assert len(db.rows) == 9
    assert ex2.plan.submeshes == ((1, 1), (1, 1)) and len(ex2.plan.stage_layers) == 2


def test_stage_intra_op_sharding_from_param_sharding_fn():
    """A stage's own intra-op plan: weights split over its mesh's model axis (Megatron
    style) give the same numbers and show up in the compiled stage program."""
    from jax.sharding import PartitionSpec as P

    opt = optax.sgd(0.1)
    state = init_state(opt)
    batch = make_batch(jax.random.PRNGKey(2), MICRO * 2)
    shard_last = lambda stage, leaf, aval, mesh: (
        P(None, "model") if aval.ndim == 2 and aval.shape[1] % mesh.shape["model"] == 0 else P())
    # price (1, 4) views lowest so each 4-device stage is a pure model-parallel mesh
    cost = lambda r, sub, lm: (1.0 if lm[0] == 1 else 2.0, 0.0)
    ex = build_pipeshard(make_step(opt, markers=True), (state, batch),
                         PipeshardParallel(num_micro_batches=2, num_stages=2),
                         stage_cost_fn=cost, compiler_options=FAST, param_sharding_fn=shard_last)
    assert ex.plan.logical_meshes == ((1, 4), (1, 4))
    new_state, loss = ex(state, batch)
    ref_state, ref_loss = _reference("sgd", opt, state, batch, True)
    _assert_close(loss, ref_loss)
    _assert_close(new_state, ref_state)
    fwd = ex.stage_programs()[1]["forward"]
    specs = [s.spec for s in jax.tree.leaves(fwd.input_shardings[0])]
    assert P(None, "model") in specs
    assert "all-reduce" in fwd.as_text() or "all-gather" in fwd.as_text()


def test_plan_for_a_cluster_model_without_devices():
    """plan_pipeshard plans from shapes alone for a cluster that is not here."""
    from autopar.cluster import Cluster
    from autopar.pipeline.api import plan_pipeshard, plan_to_dict

    opt = optax.adam(1e-3)
    state = jax.eval_shape(lambda: init_state(opt))
    batch = jax.eval_shape(lambda: make_batch(jax.random.PRNGKey(0), 64))
    cluster = Cluster.parse("2x4:a100-80g")
    plan = plan_pipeshard(make_step(opt, markers=True), (state, batch),
                          PipeshardParallel(num_micro_batches=8, num_stages=2), cluster)
    assert sorted(i for ids in plan.device_ids for i in ids) == list(range(8))
    assert len(plan.stage_layers) == 2 and plan.stage_layers[0][0] == 0
    assert plan.stage_layers[-1][1] == len(plan.layer_cuts) - 1 == 5   # 4 markers -> 5 layers
    d = plan_to_dict(plan)
    assert d["predicted_step_s"] == pytest.approx(
        sum(c.micro_batch_s + c.iteration_s for c in plan.stage_costs)
        + 7 * max(c.micro_batch_s for c in plan.stage_costs))


def test_intra_op_ilp_as_stage_cost():
    """The intra-op ILP prices each candidate stage (forward + backward traced into an op
    graph) once; the pipeline it chooses runs and matches one device."""
    from autopar.cluster import Cluster
    from autopar.pipeline.api import trace_step
    from autopar.pipeline.ilp_cost import IntraOpStageCost

    step = _two_stage_step

    p = {"w1": jnp.full((32, 32), 0.01), "w2": jnp.full((32, 16), 0.02)}
    x = jnp.ones((8, 32))
    method = PipeshardParallel(num_micro_batches=2)
    traced = trace_step(step, (p, x), 2)
    cost = IntraOpStageCost(traced.loss_jaxpr, traced.call.diff_leaf_mask, Cluster.preset("a100-80g", 1, 4))
    ex = build_pipeshard(step, (p, x), method, devices=jax.devices()[:4], stage_cost_fn=cost,
                         compiler_options=FAST)
    # 3 layer ranges x ((1,1): 1 view, (1,2): 2 views, (1,4): 3 views)
    assert len(cost.cache) == 3 * 6
    cuts = ex.plan.layer_cuts
    for (a, b), sub, lm, c in zip(ex.plan.stage_layers, ex.plan.submeshes, ex.plan.logical_meshes,
                                  ex.plan.stage_costs):
        assert c.micro_batch_s == cost.cache[((cuts[a], cuts[b]), sub, lm)][0]
    new_p, l = ex(p, x)
    ref_p, ref_l = jax.jit(step)(p, x)
    _assert_close(l, ref_l)
    _assert_close(new_p, ref_p)
    # each stage's parameters are laid out as the ILP planned them for that stage
    place = cost.param_sharding_fn_for(ex.plan)
    for s, prog in enumerate(ex.stage_programs()):
        got = [sh.spec for sh in jax.tree.leaves(prog["forward"].input_shardings[0][0])]
        want = [place(s, leaf, None, None) for leaf in ex.specs[s].param_leaves]
        assert got == want


def test_inputs_outside_the_batch_go_whole_to_every_micro_batch():
    """With batch_argnums, a loss input that does not come from the batch (a PRNG key for
    dropout) is not split; the result matches one device."""
    def loss(p, batch, key):
        h = jnp.tanh(batch @ p["w1"])
        keep = jax.random.bernoulli(key, 0.5, h.shape[1:])          # same mask for every row
        h = mark_stage_boundary(jnp.where(keep, h, 0.0))
        return jnp.mean((h @ p["w2"]) ** 2)

    def step(p, batch, key):
        l, g = value_and_grad(loss)(p, batch, key)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l

    p = {"w1": jnp.full((8, 8), 0.1), "w2": jnp.full((8, 4), 0.2)}
    x = jnp.arange(32.0).reshape(4, 8) / 32
    key = jax.random.PRNGKey(7)                                     # raw uint32[2]
    ex = build_pipeshard(step, (p, x, key), PipeshardParallel(num_micro_batches=2, num_stages=2),
                         devices=jax.devices()[:2], compiler_options=FAST, batch_argnums=(1,))
    assert ex.traced.split_mask == (False, False, True, False)
    new_p, l = ex(p, x, key)
    ref_p, ref_l = jax.jit(step)(p, x, key)
    _assert_close(l, ref_l)
    _assert_close(new_p, ref_p)


def test_given_submeshes_are_used_in_order():
    from autopar.cluster import Cluster
    from autopar.pipeline.api import plan_pipeshard

    opt = optax.sgd(0.1)
    state = jax.eval_shape(lambda: init_state(opt))
    batch = jax.eval_shape(lambda: make_batch(jax.random.PRNGKey(0), 16))
    cluster = Cluster.parse("1x8:a100-80g")
    subs = [(1, 2), (1, 4), (1, 2)]
    plan = plan_pipeshard(make_step(opt, markers=True), (state, batch),
                          PipeshardParallel(num_micro_batches=4, submeshes=subs), cluster)
    assert list(plan.submeshes) == subs
    assert [len(ids) for ids in plan.device_ids] == [2, 4, 2]
    assert sorted(i for ids in plan.device_ids for i in ids) == list(range(8))
    with pytest.raises(ValueError, match="use 6 devices"):
        plan_pipeshard(make_step(opt, markers=True), (state, batch),
                       PipeshardParallel(num_micro_batches=4, submeshes=[(1, 2), (1, 4)]), cluster)
