"""What autopar refuses or handles when given bad or unusual input, and how it says so
(the tuning database and the kernel search have theirs in test_bad_input_tuning.py)."""
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.cli import main
from models import assert_tree_close, make


def _dropout_step(typed: bool = True):
    """An MLP with dropout; the PRNG key (typed, or a raw uint32 key) is part of the state."""
    opt = optax.sgd(0.1)
    params = {"w1": jnp.ones((16, 32)) * 0.1, "w2": jnp.ones((32, 4)) * 0.1}

    def loss_fn(p, batch, key):
        x, y = batch
        h = jax.nn.relu(x @ p["w1"])
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = jnp.where(keep, h / 0.9, 0.0)
        return jnp.mean((h @ p["w2"] - y) ** 2)

    def step(state, batch):
        p, o, key = state
        key, sub = jax.random.split(key)
        loss, g = jax.value_and_grad(loss_fn)(p, batch, sub)
        u, o = opt.update(g, o, p)
        return (optax.apply_updates(p, u), o, key), loss

    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    y = jax.random.normal(jax.random.PRNGKey(2), (8, 4))
    key = jax.random.key(0) if typed else jax.random.PRNGKey(0)
    return step, (params, opt.init(params), key), (x, y)


@pytest.mark.parametrize("method", ["auto", "data_parallel", "zero3", "megatron"])
@pytest.mark.parametrize("typed", [True, False])
def test_a_step_with_a_prng_key_plans_and_matches_one_device(method, typed):
    """Dropout drawn from a key kept in the state, typed or raw, under every single-program
    method: the same mask as one device (RNG ops run replicated), so equal results."""
    step, state, batch = _dropout_step(typed)
    m = {"auto": "auto", "data_parallel": autopar.DataParallel(), "zero3": autopar.ZeRO3(),
         "megatron": autopar.Megatron(tp=2)}[method]
    (p1, _, k1), loss = autopar.parallelize(step, method=m)(state, batch)
    (p2, _, k2), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)
    unwrap = jax.random.key_data if typed else np.asarray
    np.testing.assert_array_equal(unwrap(k1), unwrap(k2))


@pytest.mark.parametrize("devices,error,match", [
    (lambda d: [d[0], d[0], d[1], d[1]], ValueError, "more than once"),
    (lambda d: [d[0]] * 8, ValueError, "more than once"),
    (lambda d: [0, 1], TypeError, "jax devices"),
    (lambda d: [], ValueError, "nothing to run on"),
])
def test_bad_device_lists_are_refused_up_front(devices, error, match):
    step, state, batch = make("mlp", "sgd")
    with pytest.raises(error, match=match):
        autopar.parallelize(step, devices=devices(jax.devices()))


@pytest.mark.parametrize("budget", [1e30, 2 ** 70])
def test_astronomical_budgets_plan_like_no_budget(budget):
    step, state, batch = make("mlp", "sgd")
    plan = autopar.parallelize(step, memory_budget=budget, remat="none").get_plan(state, batch)
    free = autopar.parallelize(step, remat="none").get_plan(state, batch)
    assert plan.stages[0].mesh_shape == free.stages[0].mesh_shape


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    step, state, batch = make("mlp", "sgd")
    plan = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(2, 4))).get_plan(state, batch)
    path = tmp_path_factory.mktemp("plans") / "p.json"
    plan.save(path)
    return step, state, batch, path


def _edited(path, tmp_path, edit):
    d = json.loads(path.read_text())
    edit(d)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(d))
    return out


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["stages"][0]["inputs"][0].update(spec=[["z"], []]), "unknown mesh axis 'z'"),
    (lambda d: d["stages"][0]["inputs"][0].update(spec=[["x", "x"], []]), "does not fit"),
    (lambda d: d["stages"][0]["inputs"][0].update(shape=[3, 5]), "shape"),
    (lambda d: d["stages"][0]["intermediates"][0].update(op=10 ** 6), "not in the traced step"),
    (lambda d: d["stages"][0].update(mesh_shape=[3, 4]), "does not fit|devices"),
    (lambda d: d["stages"][0].update(device_ids=[0, 0, 1, 1, 2, 2, 3, 3]), "repeat a device"),
])
def test_plan_files_with_bad_content_give_plan_file_errors(saved, tmp_path, edit, match):
    step, state, batch, path = saved
    with pytest.raises(autopar.PlanFileError, match=match):
        autopar.parallelize(step, plan=_edited(path, tmp_path, edit)).get_plan(state, batch)


def test_a_plan_for_8_devices_is_refused_on_4(saved):
    step, state, batch, path = saved
    with pytest.raises(autopar.PlanFileError, match="8 devices"):
        autopar.parallelize(step, plan=path, devices=jax.devices()[:4]).get_plan(state, batch)


def test_schema_version_as_a_string_and_saved_file_mode(saved, tmp_path):
    _, _, _, path = saved
    bad = _edited(path, tmp_path, lambda d: d.update(schema_version="2"))
    with pytest.raises(autopar.PlanFileError, match="schema_version '2'.*integer"):
        autopar.Plan.load(bad)
    umask = os.umask(0o022)
    try:
        autopar.Plan.load(path).save(tmp_path / "mode.json")
    finally:
        os.umask(umask)
    assert (tmp_path / "mode.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("argv,match", [
    (["plan", "--memory-budget", "abc"], "cannot read memory size"),
    (["plan", "--hidden", "100", "--heads", "3"], "not a multiple of heads"),
    (["plan", "--method", "pipeshard", "--micro-batches", "zero"], "--micro-batches"),
    (["plan", "--step", "no_such_module:f"], "cannot import"),
    (["demo", "--method", "megatron:3"], "divisible by tp"),
    (["demo", "--hidden", "10", "--heads", "4"], "not a multiple of heads"),
])
def test_cli_bad_arguments_print_one_line_and_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert __import__("re").search(match, err), err


def _while_step(w, x):
    y = jax.lax.while_loop(lambda c: jnp.sum(c) > 1.0, lambda c: c * 0.5, x @ w)
    return jnp.sum(y)


def _cond_step(w, x):
    h = x @ w
    y = jax.lax.cond(jnp.sum(h) > 0, lambda c: c * 2.0, lambda c: c - 1.0, h)
    return jnp.sum(y)


@pytest.mark.parametrize("prim,step", [("while", _while_step), ("cond", _cond_step)])
def test_control_flow_planned_replicated_is_said_once(prim, step):
    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        from autopar.strategies import _warned
        _warned.discard(prim)
        autopar.parallelize(step, batch_argnums=(1,)).get_plan(w, x)
        autopar.parallelize(step, batch_argnums=(1,)).get_plan(w, x)   # said once per process
    msgs = [str(r.message) for r in rec if f"`{prim}`" in str(r.message)]
    assert len(msgs) == 1 and "replicated" in msgs[0]


def test_an_op_on_literals_only_plans_without_warnings():
    """`jnp.sum(3.0)` traces to a reduce_sum whose only input is a literal: a constant."""
    def step(w, x):
        return jnp.sum(x @ w) * jnp.sum(jnp.float32(3.0))

    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pstep = autopar.parallelize(step, batch_argnums=(1,))
        np.testing.assert_allclose(pstep(w, x), step(w, x), rtol=1e-6)


def test_memory_budget_error_with_remat_on_does_not_ask_to_enable_it():
    step, state, batch = make("gpt", "sgd")
    with pytest.raises(autopar.MemoryBudgetError) as err:
        autopar.parallelize(step, memory_budget="1KB", remat="auto").get_plan(state, batch)
    assert "already on" in str(err.value)
    with pytest.raises(autopar.MemoryBudgetError) as err:
        autopar.parallelize(step, memory_budget="1KB", remat="none").get_plan(state, batch)
    assert "remat='auto'" in str(err.value)
