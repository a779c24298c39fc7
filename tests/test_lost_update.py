"""A train step that computes a gradient but returns nothing computed from it (the nnx.jit
style: modules and an nnx.Optimizer updated in place) is refused with an error that says
what to return, under every method; the same step returning its state trains as nnx.jit
does, and steps without a gradient (evaluation, inference) are not refused."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from autopar.lost_update import has_dead_matmul
from pipeline_gpt import init_state, make_batch, make_step
from rockmate.graph import trace_graph

METHODS = {"auto": "auto", "pipeshard": autopar.PipeshardParallel(num_micro_batches=2, num_stages=2)}


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = x + jax.nn.gelu(b(x))
        return self.head(x)


def _model_and_optimizer():
    model = _MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)


def _batch():
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
    return x, jnp.sin(x[:, :1])


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def nnx_jit_style_step(model, optimizer, batch):
    """Written for nnx.jit: updates the model and optimizer in place, returns the loss."""
    loss, grads = nnx.value_and_grad(_mse)(model, batch)
    optimizer.update(model, grads)
    return loss


def returns_nothing_step(model, optimizer, batch):
    nnx_jit_style_step(model, optimizer, batch)


def returns_state_step(model, optimizer, batch):
    loss = nnx_jit_style_step(model, optimizer, batch)
    return model, optimizer, loss


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("step", [nnx_jit_style_step, returns_nothing_step])
def test_an_nnx_jit_style_step_is_refused_with_what_to_return(step, method):
    model, optimizer = _model_and_optimizer()
    before = np.asarray(model.head.kernel[...])
    pstep = autopar.parallelize(step, method=METHODS[method], batch_argnums=(2,), devices=jax.devices()[:2])
    with pytest.raises(autopar.NoUpdateReturnedError) as e:
        pstep(model, optimizer, _batch())
    msg = str(e.value)
    assert "returns nothing computed from it" in msg
    assert "args[0] (_MLP: 6 arrays)" in msg and "args[1] (Optimizer" in msg and "in place" in msg
    assert "nnx.split" in msg and "nnx.merge" in msg and "return nnx.state((model, optimizer))" in msg
    np.testing.assert_array_equal(model.head.kernel[...], before)   # nothing ran


def test_a_plain_jax_step_that_drops_its_update_is_refused():
    opt = optax.sgd(0.1)
    params = {"w": jnp.ones((16, 8)), "v": jnp.ones((8, 1))}

    def step(state, batch):
        params, opt_state = state
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: ((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2).mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        optax.apply_updates(params, updates)       # result dropped
        return loss

    with pytest.raises(autopar.NoUpdateReturnedError, match=r"return the new parameters and optimizer state"):
        autopar.parallelize(step, devices=jax.devices()[:2])((params, opt.init(params)), _batch())


@pytest.mark.parametrize("method", METHODS)
def test_the_same_step_returning_its_state_trains_as_nnx_jit_does(method):
    """Independent reference: nnx.jit on the in-place step, applied to another copy."""
    ref_model, ref_optimizer = _model_and_optimizer()
    ref_loss = nnx.jit(nnx_jit_style_step)(ref_model, ref_optimizer, _batch())
    model, optimizer = _model_and_optimizer()
    pstep = autopar.parallelize(returns_state_step, method=METHODS[method], batch_argnums=(2,),
                                devices=jax.devices()[:2])
    new_model, new_optimizer, loss = pstep(model, optimizer, _batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(nnx.state(new_model)), jax.tree_util.tree_leaves(nnx.state(ref_model))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(new_optimizer.step[...]) == 1


def test_steps_without_a_gradient_are_not_refused():
    """Evaluating a loss or predicting computes no gradient: nothing to return."""
    model, _ = _model_and_optimizer()
    batch = _batch()
    eval_step = autopar.parallelize(_mse, batch_argnums=(1,), devices=jax.devices()[:2])
    np.testing.assert_allclose(eval_step(model, batch), _mse(model, batch), rtol=1e-5)
    predict = autopar.parallelize(lambda m, x: m(x), batch_argnums=(1,), devices=jax.devices()[:2])
    np.testing.assert_allclose(predict(model, batch[0]), model(batch[0]), rtol=1e-5, atol=1e-6)


def test_a_step_that_returns_its_update_costs_no_second_trace():
    """The second trace (gradient call as one op) is only made for a graph with a dead
    matmul: a train step returning its update has none, the nnx.jit-style step has."""
    opt = optax.adam(0.1)
    graph = trace_graph(make_step(opt, grad_api="jax.value_and_grad"), init_state(opt),
                        make_batch(jax.random.PRNGKey(0), 8))
    assert not has_dead_matmul(graph)
    model, optimizer = _model_and_optimizer()
    assert has_dead_matmul(trace_graph(nnx_jit_style_step, model, optimizer, _batch()))
