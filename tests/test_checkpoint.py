"""Checkpoints of a planned step's sharded state (`autopar.save_checkpoint` /
`restore_checkpoint`): restored values equal what was saved in any target layout, training
resumed from a checkpoint equals training straight through, an interrupted save keeps the
previous checkpoint, and damaged checkpoints are refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import autopar
from autopar import checkpoint as ckpt
from models import make


def _spmd_step():
    step, state, batch = make("gpt_scan", "sgd")
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, lowering="spmd")
    return autopar.parallelize(step, method=method), step, state, batch


def _leaves_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_from_a_checkpoint_equals_training_straight_through(tmp_path):
    pstep, step, state, batch = _spmd_step()
    s1, _ = pstep(state, batch)          # stacked weights split over the stage axis
    autopar.save_checkpoint(tmp_path / "ck", s1)
    straight, loss = pstep(s1, batch)
    resumed = autopar.restore_checkpoint(tmp_path / "ck", like=s1)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree_util.tree_leaves(resumed),
                                                         jax.tree_util.tree_leaves(s1)))
    _leaves_equal(resumed, s1)
    again, loss2 = pstep(resumed, batch)
    assert float(loss2) == float(loss)
    _leaves_equal(again, straight)


def test_restore_reshards_onto_other_layouts(tmp_path):
    pstep, step, state, batch = _spmd_step()
    s1, _ = pstep(state, batch)
    autopar.save_checkpoint(tmp_path / "ck", s1)
    one = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=SingleDeviceSharding(jax.devices()[3])), s1)
    on_one = autopar.restore_checkpoint(tmp_path / "ck", like=one)
    assert {d for x in jax.tree_util.tree_leaves(on_one) for d in x.sharding.device_set} == {jax.devices()[3]}
    _leaves_equal(on_one, s1)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    other = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P(*(["b"] if x.ndim and x.shape[0] % 2 == 0 else []))
                                                 )), s1)
    _leaves_equal(autopar.restore_checkpoint(tmp_path / "ck", like=other), s1)
    # a single-device step resumes from it too
    ref, ref_loss = jax.jit(step)(jax.tree_util.tree_map(np.asarray, s1), batch)
    got, loss = jax.jit(step)(on_one, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)


def test_dtypes_scalars_and_host_values_round_trip(tmp_path):
    tree = {"bf16": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4), "step": jnp.int32(7),
            "host": np.linspace(0, 1, 5, dtype=np.float32), "flag": np.bool_(True)}
    autopar.save_checkpoint(tmp_path / "ck", tree)
    back = autopar.restore_checkpoint(tmp_path / "ck", like=tree)
    assert back["bf16"].dtype == jnp.bfloat16 and back["step"].shape == ()
    _leaves_equal(back, tree)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    autopar.save_checkpoint(tmp_path / "ck", first)
    calls = []
    real = ckpt._chunks

    def dies_on_second_leaf(x):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed while saving")
        return real(x)

    monkeypatch.setattr(ckpt, "_chunks", dies_on_second_leaf)
    with pytest.raises(KeyboardInterrupt):
        autopar.save_checkpoint(tmp_path / "ck", {"w": jnp.full((4, 4), 2.0), "b": jnp.ones(4)})
    monkeypatch.setattr(ckpt, "_chunks", real)
    assert (tmp_path / "ck.partial").exists()
    _leaves_equal(autopar.restore_checkpoint(tmp_path / "ck", like=first), first)
    second = {"w": jnp.full((4, 4), 3.0), "b": jnp.ones(4)}
    autopar.save_checkpoint(tmp_path / "ck", second)      # the next save cleans up and replaces
    assert not (tmp_path / "ck.partial").exists()
    _leaves_equal(autopar.restore_checkpoint(tmp_path / "ck", like=first), second)


def test_damaged_checkpoints_are_refused_by_name(tmp_path):
    tree = {"w": jnp.arange(16.0).reshape(4, 4)}
    with pytest.raises(autopar.CheckpointError, match="no metadata.json"):
        autopar.restore_checkpoint(tmp_path / "missing", like=tree)
    autopar.save_checkpoint(tmp_path / "ck", tree)
    with pytest.raises(autopar.CheckpointError, match="holds 1 arrays"):
        autopar.restore_checkpoint(tmp_path / "ck", like={"w": tree["w"], "b": tree["w"]})
    with pytest.raises(autopar.CheckpointError, match="the trees differ"):
        autopar.restore_checkpoint(tmp_path / "ck", like={"v": tree["w"]})
    chunk = next((tmp_path / "ck" / "leaf0").iterdir())
    chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(autopar.CheckpointError, match="truncated"):
        autopar.restore_checkpoint(tmp_path / "ck", like=tree)
    (tmp_path / "ck" / "metadata.json").write_text("{not json")
    with pytest.raises(autopar.CheckpointError, match="corrupt"):
        autopar.restore_checkpoint(tmp_path / "ck", like=tree)
