"""Pipelines and remat find the loss of a train step written with any gradient API built on
jax.value_and_grad (jax.grad, nnx.value_and_grad, has_aux), not only autopar's marker."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax import nnx
from jax._src import api as jax_api

import autopar
from pipeline_gpt import _block, _ln, init_state, loss_fn, make_batch, make_step

_JAX_VJP = jax_api.vjp


def _assert_close(got, want, rtol=1e-4, atol=1e-6):
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("grad_api,closure,schedule,B", [
    ("jax.value_and_grad", False, "1f1b", 4),
    ("jax.grad", True, "gpipe", 2),
])
def test_pipelines_find_the_jax_gradient_call(grad_api, closure, schedule, B):
    """The step calls jax.value_and_grad / jax.grad itself (the batch bound as a
    non-differentiated argument, or closed over); the pipeline equals one device."""
    opt = optax.sgd(0.1, momentum=0.9)     # an optimizer state, linear in the gradient
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(3), 8)
    step = make_step(opt, closure=closure, grad_api=grad_api)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(
        num_micro_batches=B, num_stages=2, schedule=schedule))
    plan = pstep.get_plan(state, batch)
    assert len(plan.stages) == 2 and plan.num_micro_batches == B
    (p1, o1), loss = pstep(state, batch)
    (p2, o2), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)
    _assert_close(p1, p2)
    _assert_close(o1, o2)
    assert jax_api.vjp is _JAX_VJP       # the hook is gone once tracing ends


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(4)])
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = x + jax.nn.gelu(b(x))
        return self.head(x)


def test_nnx_value_and_grad_in_a_pipeline():
    """nnx.value_and_grad (which differentiates with has_aux=True to return the modules'
    state) on a split/merge step: pipelined, equal to one device."""
    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)

    def step(params, batch):
        x, y = batch
        model = nnx.merge(graphdef, params)
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

    x = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
    batch = (x, jnp.sin(x[:, :1]))
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # nnx's aux is the modules' state: nothing recomputed
        p1, l1 = pstep(params, batch)
    p2, l2 = jax.jit(step)(params, batch)
    assert len(pstep.get_plan(params, batch).stages) == 2
    _assert_close(l1, l2)
    _assert_close(p1, p2)


def _aux_loss(params, batch):
    """The pipeline GPT's loss with its accuracy and a parameter norm as aux."""
    x = params["embed"][batch["tokens"]] + params["pos"]
    for p in params["blocks"]:
        x = _block(p, x)
    logits = _ln(x, params["ln_f"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()
    acc = (logits.argmax(-1) == batch["targets"]).mean()
    return loss, {"accuracy": acc, "ln_f_norm": jnp.vdot(params["ln_f"], params["ln_f"])}


def _aux_step(opt, aux_fn):
    def step(state, batch):
        params, opt_state = state
        (loss, aux), grads = jax.value_and_grad(aux_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, aux)
    return step


def test_has_aux_in_a_pipeline_equals_one_device_and_names_the_extra_forward():
    """Aux values are computed at the full batch beside the pipelined gradient, so they equal
    one device exactly; aux built from activations warns that it costs a forward pass, aux
    from parameters alone does not."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(4), 8)
    step = _aux_step(opt, _aux_loss)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=4, num_stages=2))
    with pytest.warns(UserWarning, match="recomputed at the full batch"):
        (p1, _), (l1, aux1) = pstep(state, batch)
    (p2, _), (l2, aux2) = jax.jit(step)(state, batch)
    _assert_close(l1, l2)
    _assert_close(aux1, aux2)
    _assert_close(p1, p2)

    cheap = _aux_step(opt, lambda p, b: (loss_fn(p, b), jnp.vdot(p["ln_f"], p["ln_f"])))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        (_, _), (_, norm) = autopar.parallelize(
            cheap, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))(state, batch)
    np.testing.assert_allclose(norm, jnp.vdot(state[0]["ln_f"], state[0]["ln_f"]), rtol=1e-6)


def test_remat_finds_the_jax_gradient_call():
    """remat="full" puts a rockmate schedule on the loss of a jax.value_and_grad step with
    has_aux: the plan says rockmate, the program carries its barriers, loss, aux and
    updated parameters equal one device."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(5), 8)
    step = _aux_step(opt, _aux_loss)
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(2, 4)), remat="full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = pstep.get_plan(state, batch)
        got = pstep(state, batch)
    assert plan.remat.applied == "rockmate", plan.remat
    assert "optimization_barrier" in pstep.lower(state, batch).as_text()
    _assert_close(got, jax.jit(step)(state, batch), rtol=2e-4)


def test_an_invisible_gradient_gets_a_clear_error_and_jax_is_left_as_it_was():
    """A gradient taken with jax.vjp is not a loss the tracer can see: the error says how to
    mark it. Whatever happens, jax's own vjp is back in place afterwards."""
    original = _JAX_VJP
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(6), 8)

    def vjp_step(state, batch):
        params, o = state
        loss, pull = jax.vjp(lambda p: loss_fn(p, batch), params)
        (grads,) = pull(jnp.ones_like(loss))
        return (jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), o), loss

    with pytest.raises(ValueError, match="autopar.value_and_grad"):
        autopar.parallelize(vjp_step, method=autopar.PipeshardParallel(num_micro_batches=2))(state, batch)
    assert jax_api.vjp is original

    def failing_step(state, batch):
        jax.value_and_grad(loss_fn)(state[0], batch)
        raise RuntimeError("user code failed")

    with pytest.raises(RuntimeError, match="user code failed"):
        autopar.parallelize(failing_step, method=autopar.PipeshardParallel(num_micro_batches=2))(state, batch)
    assert jax_api.vjp is original
    # outside autopar, jax.value_and_grad is untouched
    v, g = jax.value_and_grad(loss_fn)(state[0], batch)
    np.testing.assert_allclose(v, loss_fn(state[0], batch), rtol=1e-6)


class _DropoutLM(nn.Module):
    """A small linen LM with dropout after every block."""
    vocab: int = 32
    width: int = 32
    layers: int = 4

    @nn.compact
    def __call__(self, tokens, train: bool):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(self.layers):
            x = x + nn.Dropout(0.2, deterministic=not train)(nn.gelu(nn.Dense(self.width)(nn.LayerNorm()(x))))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _dropout_step(model, opt, train):
    def step(state, batch):
        params, opt_state, key = state
        key, sub = jax.random.split(key)

        def loss(p):
            logits = model.apply(p, batch["tokens"], train, rngs={"dropout": sub})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), value
    return step


@pytest.mark.parametrize("method", ["auto", "pipeline"])
def test_a_linen_lm_with_dropout_and_a_key_in_the_state(method):
    """Plain flax linen + jax.value_and_grad, the dropout key kept in the state: the
    default method with dropout on, and a 2-stage pipeline with dropout off (each
    micro-batch would draw its own mask: equal only in distribution), equal one device
    for two consecutive steps, keys included."""
    model, opt = _DropoutLM(), optax.adamw(1e-2)
    batch = make_batch(jax.random.PRNGKey(7), 8)
    batch = {k: v % 32 for k, v in batch.items()}
    params = model.init(jax.random.PRNGKey(0), batch["tokens"], False)
    state = (params, opt.init(params), jax.random.key(3))
    step = _dropout_step(model, opt, train=method == "auto")
    pstep = autopar.parallelize(step, **({} if method == "auto" else dict(
        method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))))
    got, want = state, state
    for _ in range(2):
        got, loss = pstep(got, batch)
        want, ref = jax.jit(step)(want, batch)
        _assert_close(loss, ref)
        _assert_close(got[:2], want[:2], rtol=2e-4)
        np.testing.assert_array_equal(jax.random.key_data(got[2]), jax.random.key_data(want[2]))
    if method == "pipeline":
        assert len(pstep.get_plan(state, batch).stages) == 2
