"""The SPMD pipeline (`PipeshardParallel(lowering="spmd")`): a loss whose layers are one
scan, pipelined over a stage mesh axis inside one jit. Checked against one device, the
compiled program (collective-permutes, argument bytes, layouts) and its own predictions."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import autopar
from autopar.model_zoo.gpt import GPT, GPTConfig
from autopar.model_zoo.train_step import cross_entropy, language_model_setup
from autopar.pipeline.spmd import SpmdPipelineError, find_layer_scan
from autopar.pipeline.spmd_plan import SpmdPlanner
from autopar.pipeline.trace import StepTracer
from autopar.cluster import Cluster

LR = 0.5


def _gpt(layers=4, scan=True, opt=None):
    cfg = GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=layers, batch=8, scan=scan)
    model = GPT(cfg)

    def loss_fn(p, batch):
        return cross_entropy(model.apply({"params": p}, batch[0]), batch[1])

    return language_model_setup(model, loss_fn, cfg, opt or optax.sgd(LR), 0)


def _masked_scan_model():
    """A hand-written lax.scan stack whose every layer reads a mask built from the batch
    (a batch-derived constant of the scan, split into micro-batches with the carry)."""
    L, H, V = 4, 16, 32
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"emb": jax.random.normal(k[0], (V, H)) * 0.5, "w": jax.random.normal(k[1], (L, H, H)) / np.sqrt(H),
              "b": jnp.zeros((L, H)), "head": jax.random.normal(k[2], (H, V)) * 0.1}
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 6), 0, V)

    def loss_fn(p, tokens):
        mask = (tokens % 3 != 0).astype(jnp.float32)[..., None]
        x = p["emb"][tokens]

        def layer(x, wb):
            w, b = wb
            return x + jnp.tanh(x @ w + b) * mask, None

        x, _ = lax.scan(layer, x, (p["w"], p["b"]))
        logits = x @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(tokens, -1, 1)).mean()

    opt = optax.sgd(LR)

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, opt.init(params)), tokens


def _assert_steps_match(step, state, batch, method, steps=2):
    """Losses and gradients (sgd: the parameter change / LR) equal jax.jit on one device
    for `steps` consecutive steps, the pipeline's outputs fed back as its inputs."""
    pstep = autopar.parallelize(step, method=method)
    ref = jax.jit(step)
    s, r = state, state
    for _ in range(steps):
        new_s, loss = pstep(s, batch)
        new_r, ref_loss = ref(r, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-4)
        for a, b, p0, q0 in zip(jax.tree_util.tree_leaves(new_s[0]), jax.tree_util.tree_leaves(new_r[0]),
                                jax.tree_util.tree_leaves(s[0]), jax.tree_util.tree_leaves(r[0])):
            g, want = (np.asarray(p0) - np.asarray(a)) / LR, (np.asarray(q0) - np.asarray(b)) / LR
            # a gradient read back from p - LR * g is exact to a few ulps of p
            ulps = 4 * np.finfo(np.float32).eps * np.abs(np.asarray(q0)).max() / LR
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=ulps + 1e-6 * np.abs(want).max())
        s, r = new_s, new_r
    return pstep, s


@pytest.mark.parametrize("stages", [2, 4])
def test_nn_scan_gpt_equals_one_device(stages):
    step, state, batch = _gpt()
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=stages, lowering="spmd")
    pstep, out = _assert_steps_match(step, state, batch, method)
    sp = pstep.plan.spmd_pipeline
    assert (sp.num_stages, sp.data_parallel, sp.num_micro_batches, sp.num_layers) == (stages, 8 // stages, 2, 4)
    # the stacked weights come back split over the stages, one L/S slab per stage
    stacked = [a for a in jax.tree_util.tree_leaves(out[0]["blocks"]) if a.ndim == 3]
    assert stacked and all(a.shape[0] == 4 and a.sharding.spec[0] == "x" for a in stacked)
    assert {s.data.shape[0] for a in stacked for s in a.addressable_shards} == {4 // stages}
    compiled = pstep.lower(state, batch).compile()
    text = compiled.as_text()
    assert "collective-permute" in text             # stage-to-stage sends, inside the one program
    assert len(compiled.stages) == 1
    ma = compiled.memory_analysis()[0]
    assert ma.argument_size_in_bytes == sp.predicted_argument_bytes
    # gradients, kept carries and one tick's residuals (JAX's, before XLA fuses them) vs
    # XLA's temp, which also holds copies and collective buffers: the same size
    predicted = sp.predicted_gradient_bytes + sp.predicted_activation_bytes
    assert predicted / 2 < ma.temp_size_in_bytes < 2 * predicted


def test_batch_derived_constants_are_split_into_micro_batches():
    step, state, tokens = _masked_scan_model()
    tracer = StepTracer(step, (state, tokens))
    scan = find_layer_scan(tracer.call.loss_jaxpr, tracer.call.num_consts)
    assert scan.batch_consts == (True,) and scan.length == 4 and scan.batch_size == 8
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, lowering="spmd")
    _assert_steps_match(step, state, tokens, method)


def test_plan_round_trip_and_restore(tmp_path):
    step, state, batch = _gpt()
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, lowering="spmd")
    pstep = autopar.parallelize(step, method=method)
    new_state, loss = pstep(state, batch)
    path = tmp_path / "spmd.json"
    pstep.plan.save(path)
    plan = autopar.Plan.load(path)
    assert plan == pstep.plan and plan.spmd_pipeline.num_stages == 2
    assert "SPMD pipeline: 4 layers in 2 stages (mesh axis x) x 4 data-parallel (y), 2 micro-batches of 4, 3 ticks" \
        in plan.summary()
    again = autopar.parallelize(step, plan=str(path))      # method="auto" picks the SPMD pipeline
    new2, loss2 = again(state, batch)
    assert again.plan.spmd_pipeline == plan.spmd_pipeline
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    assert "collective-permute" in again.lower(state, batch).compile().as_text()


def test_predicted_step_follows_ticks():
    """Price arithmetic: (M + S - 1) ticks of L/S layers' forward + recomputing backward
    and two sends, plus the rest; more micro-batches cost more ticks of smaller rows."""
    step, state, batch = _gpt()
    pl = SpmdPlanner(StepTracer(step, (state, batch)), Cluster.parse("1x8:a100-80g"), 8)
    p = pl.price(2, 2)
    assert p.tick_s == pytest.approx(2 * (p.layer_forward_s + p.layer_train_s) + 2 * p.send_s)
    assert p.predicted_step_s == pytest.approx(3 * p.tick_s + p.rest_s + p.grad_sync_s)
    assert p.layer_train_s > 2 * p.layer_forward_s      # the backward costs more than the forward
    assert sorted(pl.candidates(None, "auto")) == [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
    best = pl.plan(None, "auto", float("inf"))
    assert best.predicted_step_s == min(pl.price(s, m).predicted_step_s for s, m in pl.candidates(None, "auto"))


def test_auto_lowering_takes_the_cheaper_prediction():
    step, state, batch = _gpt()
    plan = autopar.make_plan(step, state, batch, cluster="1x8:a100-80g",
                             method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))
    spmd = SpmdPlanner(StepTracer(step, (state, batch)), Cluster.parse("1x8:a100-80g"), 8).plan(2, 2, float("inf"))
    if plan.spmd_pipeline is not None:
        assert plan.spmd_pipeline.predicted_step_s < plan.spmd_pipeline.per_stage_step_s
    else:
        assert plan.predicted_time_s <= spmd.predicted_step_s


def test_bad_input_is_refused_clearly():
    step, state, batch = _gpt(scan=False)
    with pytest.raises(SpmdPipelineError, match="lax.scan"):
        autopar.make_plan(step, state, batch, cluster="1x8:a100-80g",
                          method=autopar.PipeshardParallel(num_micro_batches=2, lowering="spmd"))
    step, state, batch = _gpt(layers=4)
    with pytest.raises(SpmdPipelineError, match="4 layers do not split into 3"):
        autopar.make_plan(step, state, batch, cluster="1x6:a100-80g",
                          method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=3, lowering="spmd"))
    with pytest.raises(ValueError, match="token_slices"):
        autopar.PipeshardParallel(lowering="spmd", token_slices=2)
    with pytest.raises(ValueError, match="lowering must be one of"):
        autopar.PipeshardParallel(lowering="mpmd")


def test_scans_it_cannot_pipeline_are_named():
    x, w = jnp.ones((8, 3)), jnp.ones((4, 3, 3))

    def find(f):
        return find_layer_scan(jax.make_jaxpr(f)(x, w).jaxpr, num_batch_inputs=1)    # x is the batch

    def ys_used(x, w):
        c, ys = lax.scan(lambda c, wl: (jnp.tanh(c @ wl), c.sum()), x, w)
        return c.sum() + ys.sum()

    def batch_weights(x, w):
        return lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w * x.sum())[0].sum()

    def reverse(x, w):
        return lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w, reverse=True)[0].sum()

    def plain(x, w):
        return lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)[0].sum()

    with pytest.raises(SpmdPipelineError, match="per-layer outputs are used"):
        find(ys_used)
    with pytest.raises(SpmdPipelineError, match="depends on the batch"):
        find(batch_weights)
    with pytest.raises(SpmdPipelineError, match="reverse"):
        find(reverse)
    scan = find(plain)
    assert (scan.length, scan.batch_size, scan.stacked_shapes) == (4, 8, ((4, 3, 3),))
