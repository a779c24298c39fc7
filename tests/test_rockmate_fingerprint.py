"""A remat plan identifies its program by structure, not by the objects one trace made:
functions with custom_vjp or pure_callback (whose params hold per-trace functions) are
recognised on every call, and a different program is still refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rockmate
from rockmate.graph.signature import fingerprint, param_key
from rockmate.planner import trace


@jax.custom_vjp
def clipped_tanh(x):
    return jnp.tanh(x)


clipped_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)),
                    lambda t, g: (jnp.clip(g * (1 - t * t), -0.1, 0.1),))


def model(params, x, act=clipped_tanh):
    h = x
    for a, b in params:
        h = h + act(h @ a) @ b
    # a host callback on a value the gradient does not flow through
    scale = jax.pure_callback(lambda v: np.float32(1.0) + 0 * np.asarray(v), jax.ShapeDtypeStruct((), jnp.float32),
                              jax.lax.stop_gradient(jnp.sum(h)))
    return jnp.sum(h ** 2) * scale


def problem(width=32):
    key = jax.random.PRNGKey(0)
    params = [(jax.random.normal(jax.random.fold_in(key, i), (width, 64)) * 0.3,
               jax.random.normal(jax.random.fold_in(key, 9 + i), (64, width)) * 0.3) for i in range(4)]
    return params, jax.random.normal(key, (64, width))


def test_fingerprint_is_equal_across_traces_and_differs_for_other_programs():
    params, x = problem()
    first, again = trace(model, (params, x)), trace(model, (params, x))
    assert {"custom_vjp_call", "pure_callback"} <= {op.name for op in first.ops}
    assert fingerprint(first) == fingerprint(again)
    assert fingerprint(trace(model, problem(width=16))) != fingerprint(first)
    assert fingerprint(trace(lambda p, x: model(p, x) + 1.0, (params, x))) != fingerprint(first)
    # per-trace function params are described, not identified
    custom = [next(op for op in g.ops if op.name == "custom_vjp_call") for g in (first, again)]
    assert custom[0].params["bwd"] is not custom[1].params["bwd"]
    assert param_key(custom[0].params) == param_key(custom[1].params)


def test_remat_of_custom_vjp_and_pure_callback_runs_and_keeps_their_gradients():
    params, x = problem()
    lo = rockmate.min_budget(model, params, x, calibrate=False)
    f2 = rockmate.remat(model, lo, params, x, calibrate=False)
    assert any(not b.keep_all for b in f2.schedule.blocks)  # something is recomputed
    np.testing.assert_allclose(f2(params, x), model(params, x), rtol=1e-6)
    got, want = jax.grad(f2)(params, x), jax.grad(model)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # the rule's clipping matters here: differentiating tanh itself gives other gradients
    unclipped = jax.grad(lambda p, x: model(p, x, act=jnp.tanh))(params, x)
    assert not np.allclose(jax.tree.leaves(unclipped)[0], jax.tree.leaves(got)[0], rtol=1e-3)
    with pytest.raises(ValueError, match="different program"):
        f2(*problem(width=16))


def test_parallelize_remat_full_of_custom_vjp_and_pure_callback_runs_twice_like_jit():
    """The same structural fingerprint lets a `parallelize(remat="full")` plan be reused on
    the second call (it used to be refused as "made for a different program")."""
    import autopar

    def step(params, x):
        loss, grads = autopar.value_and_grad(model)(params, x)
        return [(a - 0.1 * ga, b - 0.1 * gb) for (a, b), (ga, gb) in zip(params, grads)], loss

    params, x = problem()
    pstep = autopar.parallelize(step, remat="full")
    assert pstep.get_plan(params, x).remat.applied == "rockmate"
    want_p, want = jax.jit(step)(params, x)
    for _ in range(2):
        got_p, got = pstep(params, x)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    # compared as updates (new - old): their float32 sums in another order (remat, LLVM's
    # code) differ by ~1e-5 of the update's scale, more than 1e-4 of an element near 0
    for g, w, p0 in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), jax.tree.leaves(params)):
        du, dw = np.asarray(g) - np.asarray(p0), np.asarray(w) - np.asarray(p0)
        np.testing.assert_allclose(du, dw, rtol=1e-4, atol=1e-4 * float(np.abs(dw).max()))
