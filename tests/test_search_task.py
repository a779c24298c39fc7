"""Tasks: constructors, from_op, stable workload keys, references against jax, bad input."""
import numpy as np
import pytest

from search import Task


def test_workload_key_is_stable_and_round_trips():
    t = Task.matmul(512, 512, 512)
    assert t.workload_key == "matmul(K=512,M=512,N=512)/float32"
    assert Task.from_dict(t.to_dict()) == t
    assert Task.from_dict(t.to_dict()).workload_key == t.workload_key
    assert Task.dense(4, 8, 2, "gelu").workload_key != Task.dense(4, 8, 2, "relu").workload_key


def test_from_op_builds_tasks_from_local_shard_shapes():
    assert Task.from_op("dot_general", [(128, 64), (64, 32)]) == Task.matmul(128, 32, 64)
    assert Task.from_op("dot_general", [(4, 128, 64), (4, 64, 32)]) == Task.batch_matmul(4, 128, 32, 64)
    assert Task.from_op("softmax", [(2, 8, 16)]) == Task.softmax(16, 16)
    assert Task.from_op("conv_general_dilated", [(1, 8, 8, 3), (3, 3, 3, 4)], pad=1) == \
        Task.conv2d(1, 8, 8, 3, 4, 3, 3, 1, 1)
    with pytest.raises(ValueError, match="contracting"):
        Task.from_op("dot_general", [(128, 64), (32, 32)])
    with pytest.raises(ValueError, match="unsupported primitive"):
        Task.from_op("scatter", [(4,)])


def test_bad_tasks_are_refused():
    with pytest.raises(ValueError, match="not supported"):
        Task.matmul(4, 4, 4, dtype="float16")
    with pytest.raises(ValueError, match="positive"):
        Task.matmul(0, 4, 4)
    with pytest.raises(ValueError, match="epilogue"):
        Task.dense(4, 4, 4, "swish")


def test_references_match_jax():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    conv = Task.conv2d(2, 7, 7, 3, 5, 3, 3, 2, 1)
    ins = conv.random_inputs(1)
    want = jax.lax.conv_general_dilated(ins["X"], ins["Wt"], (2, 2), [(1, 1), (1, 1)],
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(conv.reference(ins), want, rtol=1e-4, atol=1e-4)
    assert conv.output_shape == want.shape
    d = Task.dense(4, 6, 5, "gelu")
    ins = d.random_inputs(2)
    np.testing.assert_allclose(d.reference(ins), jax.nn.gelu(ins["A"] @ ins["B"] + ins["bias"]), rtol=1e-5, atol=1e-5)
    ln = Task.layernorm(3, 16)
    ins = ln.random_inputs(3)
    x = jnp.asarray(ins["X"])
    m, v = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    np.testing.assert_allclose(ln.reference(ins), (x - m) / jnp.sqrt(v + 1e-5) * ins["gamma"] + ins["beta"],
                               rtol=1e-4, atol=1e-4)
    sm = Task.softmax(3, 16)
    ins = sm.random_inputs(4)
    np.testing.assert_allclose(sm.reference(ins), jax.nn.softmax(ins["X"], axis=1), rtol=1e-5, atol=1e-6)
    del rng


def test_flops_count_multiply_adds():
    assert Task.matmul(8, 4, 2).flops == 2 * 8 * 4 * 2
