"""An equinox model passed to a parallelized step as it is: its leaves that are not arrays
(activation functions, strings, Python bools) are static, as `eqx.filter_jit` treats them
(`autopar/static_leaves.py`). The step equals `eqx.filter_jit(step)` under every method,
returns the same non-array leaves, plans again for another static leaf, and plans on
abstract values."""
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.plan import PlanFileError

OPT = optax.adam(1e-2)


class Net(eqx.Module):
    """An MLP (activation functions as leaves) behind a dropout in inference mode (a bool
    leaf the layer branches on) with a name (a string leaf)."""

    mlp: eqx.nn.MLP
    drop: eqx.nn.Dropout
    name: str

    def __call__(self, x):
        return self.mlp(self.drop(x))


def make_net(activation=jax.nn.gelu):
    mlp = eqx.nn.MLP(16, 4, 32, 3, activation=activation, key=jax.random.key(0))
    return Net(mlp, eqx.nn.Dropout(0.1, inference=True), "net")


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def step(model, opt_state, batch):
    x, y = batch
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def inputs(activation=jax.nn.gelu):
    model = make_net(activation)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    return model, OPT.init(eqx.filter(model, eqx.is_array)), (x, jnp.sin(x[:, :4]))


def assert_same(got, want):
    """Arrays within float tolerance; every other leaf the very same object."""
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(got_leaves, want_leaves):
        if eqx.is_array(w):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
        else:
            assert g is w


def non_arrays(tree):
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if not eqx.is_array(leaf)]


METHODS = {
    "auto": "auto",
    "pipeshard": autopar.PipeshardParallel(num_micro_batches=2, num_stages=2),
}


@pytest.mark.parametrize("method", METHODS)
def test_equinox_step_equals_filter_jit_for_two_steps(method):
    """Two consecutive steps (outputs fed back) equal eqx.filter_jit's; the returned model
    holds the input's activation functions, dropout flag and name themselves."""
    model, opt_state, batch = inputs()
    pstep = autopar.parallelize(step, method=METHODS[method], batch_argnums=(2,))
    ref = eqx.filter_jit(step)
    got, want = pstep(model, opt_state, batch), ref(model, opt_state, batch)
    assert_same(got, want)
    assert non_arrays(got[0]) == non_arrays(model) and got[0].mlp.activation is jax.nn.gelu
    got, want = pstep(*got[:2], batch), ref(*want[:2], batch)
    assert_same(got, want)
    plan = pstep.plan
    assert (len(plan.stages), plan.num_micro_batches) == ((2, 2) if method == "pipeshard" else (1, 1))
    assert "static:jax._src.nn.functions.gelu" in plan.signature and "0x" not in plan.signature


def test_another_static_leaf_plans_again_or_is_refused():
    """Another activation function is another program: the same parallelized step plans
    again (outputs equal filter_jit with the new activation), and a saved plan made for
    the old one is refused, naming the signature."""
    pstep = autopar.parallelize(step, batch_argnums=(2,))
    gelu_plan = pstep.get_plan(*inputs(jax.nn.gelu))
    relu_inputs = inputs(jax.nn.relu)
    got = pstep(*relu_inputs)
    assert pstep.plan is not gelu_plan and "functions.relu" in pstep.plan.signature
    assert_same(got, eqx.filter_jit(step)(*relu_inputs))

    reused = autopar.parallelize(step, batch_argnums=(2,), plan=autopar.Plan.from_json(gelu_plan.to_json()))
    assert_same(reused(*inputs(jax.nn.gelu)), eqx.filter_jit(step)(*inputs(jax.nn.gelu)))
    with pytest.raises(PlanFileError, match="different signature"):
        reused(*relu_inputs)


def test_make_plan_on_abstract_equinox_values_and_reuse():
    """make_plan on eqx.filter_eval_shape's model (ShapeDtypeStruct leaves beside the
    functions) plans for a cluster; the plan, saved, runs the concrete step here."""
    abstract_model = eqx.filter_eval_shape(make_net)
    model, opt_state, batch = inputs()
    abstract = lambda t: jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct(l.shape, l.dtype), t)
    plan = autopar.make_plan(step, abstract_model, abstract(opt_state), abstract(batch), cluster="1x8:a100-80g",
                             batch_argnums=(2,))
    assert plan.num_devices == 8 and plan.predicted_time_s > 0
    reused = autopar.parallelize(step, batch_argnums=(2,), plan=autopar.Plan.from_json(plan.to_json()))
    assert_same(reused(model, opt_state, batch), eqx.filter_jit(step)(model, opt_state, batch))


def test_unhashable_static_leaf_is_refused_by_name():
    """A static leaf must be hashable (it keys the plan cache); one that is not is named."""
    @dataclasses.dataclass
    class Config:                    # eq=True without frozen: unhashable
        depth: int

    model, opt_state, batch = inputs()
    with pytest.raises(TypeError, match=r"args\[0\]\.name is a Config, which is neither an array nor hashable"):
        autopar.parallelize(step, batch_argnums=(2,)).get_plan(
            eqx.tree_at(lambda m: m.name, model, Config(3)), opt_state, batch)
