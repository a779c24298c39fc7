"""A user's jax.checkpoint survives planning: the recomputation is not merged back into the
forward pass by XLA (prevent_cse), and numerics still match one device."""
import re

import jax
import jax.numpy as jnp
import numpy as np

import autopar
from rockmate.graph.trace import trace_graph


def _layer(x, w):
    return jnp.tanh(x @ w)


def _loss(ws, x, checkpoint):
    f = jax.checkpoint(_layer) if checkpoint else _layer
    for w in ws:
        x = f(x, w)
    return jnp.sum(x * x)


def _step(ws, x, checkpoint=True):
    return jax.grad(_loss)(ws, x, checkpoint)


def test_checkpointed_regions_get_a_barrier_and_the_program_recomputes():
    ws = [jax.random.normal(jax.random.PRNGKey(i), (64, 64)) / 8 for i in range(4)]
    x = jax.random.normal(jax.random.PRNGKey(9), (64, 64))
    graph = trace_graph(_step, ws, x)
    assert sum(op.name == "optimization_barrier" for op in graph.ops) == len(ws)
    assert "optimization_barrier" not in {op.name for op in trace_graph(lambda w, y: _step(w, y, False), ws, x).ops}

    pstep = autopar.parallelize(_step, method=autopar.ShardParallel(mesh_shape=(1, 8)), batch_argnums=(1,))
    got = pstep(ws, x)
    want = jax.jit(_step)(ws, x)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert pstep.lower(ws, x).as_text().count("optimization_barrier") == len(ws)
    # the compiled program recomputes: more tanh than without checkpoint. (Not "as many as
    # jax.jit's": XLA copies the tanh into the fusions that read it or not depending on the
    # layouts, and two layouts of equal cost for w0's gradient gave 7 and 6.)
    ours = _tanh_count(pstep.lower(ws, x).compile().as_text())
    plain = autopar.parallelize(lambda w, y: _step(w, y, False), method=autopar.ShardParallel(mesh_shape=(1, 8)))
    assert ours > _tanh_count(plain.lower(ws, x).compile().as_text())


def _tanh_count(hlo: str) -> int:
    return len(re.findall(r"= f32\[[0-9,]*\]\{[0-9,]*\} tanh\(", hlo))
