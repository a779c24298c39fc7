"""autopar.parallelize gives the same loss, gradients and updated parameters as jax.jit on one device."""
import jax
import pytest

import autopar
from models import LR, assert_tree_close, make

MESHES = [(1, 8), (2, 4), (4, 2)]


def _check(model, opt_name, mesh_shape, method=None):
    step, state, batch = make(model, opt_name)
    (ref_params, ref_opt), ref_loss = jax.jit(step)(state, batch)
    pstep = autopar.parallelize(step, method=method or autopar.ShardParallel(mesh_shape=mesh_shape))
    (params, opt), loss = pstep(state, batch)
    assert_tree_close(loss, ref_loss)
    # sgd: the update is lr * gradient, so parameters check the gradients tightly.
    assert_tree_close(params, ref_params, param_atol=2 * LR if opt_name == "adamw" else 0.0)
    assert_tree_close(opt, ref_opt, rtol=1e-4, floor=1e-5)
    return pstep


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("model", ["mlp", "gpt", "gpt_scan", "embed", "conv"])
def test_sgd_matches_single_device(model, mesh_shape):
    pstep = _check(model, "sgd", mesh_shape)
    assert pstep.plan.stages[0].mesh_shape == mesh_shape


@pytest.mark.parametrize("model,mesh_shape", [("mlp", (2, 4)), ("gpt", (4, 2)), ("gpt_scan", (1, 8)),
                                              ("embed", (2, 4)), ("conv", (4, 2))])
def test_adamw_matches_single_device(model, mesh_shape):
    _check(model, "adamw", mesh_shape)


@pytest.mark.parametrize("method", [autopar.DataParallel(), autopar.ZeRO3(), autopar.Megatron(tp=2), "auto"],
                         ids=["dp", "zero3", "megatron2", "auto"])
def test_methods_match_single_device(method):
    _check("gpt", "adamw", None, method=method)


def test_plan_is_cached_per_signature_and_state_keeps_its_layout():
    step, state, batch = make("mlp", "sgd")
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(2, 4)))
    p1 = pstep.get_plan(state, batch)
    new_state, _ = pstep(state, batch)
    assert pstep.get_plan(new_state, batch) is p1          # same signature: no re-planning
    half = jax.tree_util.tree_map(lambda x: x[:8], batch)
    assert pstep.get_plan(state, half) is not p1            # new batch shape: new plan
    # the new state comes back in the layout the plan chose for the old one
    st = p1.stages[0]
    n_state = len(jax.tree_util.tree_leaves(state))
    assert [t.spec for t in st.outputs[:n_state]] == [t.spec for t in st.inputs[:n_state]]


def test_donation_is_forwarded():
    step, state, batch = make("mlp", "sgd")
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)), donate_argnums=(0,))
    state = jax.tree_util.tree_map(lambda x: x + 0, state)
    leaves = jax.tree_util.tree_leaves(state)
    text = pstep.lower(state, batch).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text
    pstep(state, batch)
    assert any(x.is_deleted() for x in leaves)
