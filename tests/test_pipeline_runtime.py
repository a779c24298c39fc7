"""PipeshardParallel end to end: stages sharded by the intra-op ILP equal one device, run
on their own devices with the schedule's micro-batches in flight, plans are saved and
reused, and bad input is refused with a clear error."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.pipeline.grad import value_and_grad
from pipeline_gpt import init_state, loss_fn, make_batch, make_step


def _assert_close(got, want, rtol=1e-4, atol=1e-6):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _free_and_tight(step, state, batch, method):
    """A pipeline planned under 5% more than the smallest budget the planner can meet (it
    names it when asked for 1 KB): to fit, stages shard their parameters."""
    with pytest.raises(autopar.MemoryBudgetError) as err:
        autopar.parallelize(step, method=method, memory_budget="1KB").get_plan(state, batch)
    budget = int(1.05 * err.value.min_bytes)
    return budget, autopar.parallelize(step, method=method, memory_budget=budget)


@pytest.mark.parametrize("schedule,B,S", [("1f1b", 4, 2), ("gpipe", 1, 2), ("gpipe", 4, 4), ("1f1b", 1, 4)])
def test_ilp_sharded_stages_equal_one_device(schedule, B, S):
    """A GPT whose loss closes over the batch, pipelined under a memory budget that forces
    sharded parameters or remat in some stage; loss and sgd-updated parameters equal one
    device, every stage runs on its own devices, and the runtime keeps the schedule's
    micro-batches in flight."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 8)
    step = make_step(opt, closure=True)
    budget, pstep = _free_and_tight(step, state, batch, autopar.PipeshardParallel(
        num_micro_batches=B, num_stages=S, schedule=schedule))
    plan = pstep.get_plan(state, batch)
    assert len(plan.stages) == S and plan.num_micro_batches == B
    assert all(s.memory_bytes <= budget for s in plan.stages)
    (p1, _), loss = pstep(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)
    _assert_close(p1, p2)
    compiled = pstep.lower(state, batch).compile()
    assert len(compiled.stages) == S
    # the ILP's layouts are what runs: some stage takes a parameter split over its mesh
    split = [any(any(p is not None for p in sh.spec) for sh in prog["forward"].input_shardings[0][0])
             for prog in compiled.programs]
    assert any(split)
    devices = [{d.id for d in prog["forward"].input_shardings[0][0][0].device_set} for prog in compiled.programs]
    assert [sorted(d) for d in devices] == [sorted(s.device_ids) for s in plan.stages]
    assert all(not a & b for i, a in enumerate(devices) for b in devices[i + 1:])
    peak = pstep._executable((state, batch), {}).last_run.peak_live_micro_batches
    want = [min(S - s, B) for s in range(S)] if schedule == "1f1b" else [B] * S
    assert peak == want
    assert [s.in_flight for s in plan.stages] == want


def test_adam_with_layers_from_clustering_and_a_tied_embedding():
    """No markers, adam, the embedding read by the first and the last layer: its gradient
    is summed across stages at its owner."""
    opt = optax.adamw(1e-2)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(3), 8)
    step = make_step(opt)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, layers=4))
    (p1, o1), loss = pstep(state, batch)
    (p2, o2), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)
    _assert_close(p1, p2, atol=2e-2)        # adam: +-lr on near-zero gradients
    _assert_close(o1[0].mu, o2[0].mu, atol=1e-6)
    assert pstep.plan.pipeline.num_layers == 4


def test_unsplittable_update_falls_back_to_one_program():
    """A global gradient-norm clip mixes every stage's gradients: the update runs as one
    program on all pipeline devices, and the result still equals one device."""
    opt = optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(0.1))
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(4), 8)
    step = make_step(opt, markers=True)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))
    (p1, _), loss = pstep(state, batch)
    exe = pstep._executable((state, batch), {})
    assert exe.updates is None and exe.update_all is not None
    (p2, _), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)
    _assert_close(p1, p2)


def test_inputs_outside_the_batch_go_whole_to_every_micro_batch():
    """A mask given as its own argument (not in batch_argnums) is not split."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(5), 8)
    weights = jnp.linspace(0.5, 1.5, 8)        # per position, not per example

    def step(state, batch, w):
        params, o = state

        def loss(p):
            return loss_fn(p, batch) * jnp.mean(w)
        value, grads = value_and_grad(loss)(params)
        updates, o = opt.update(grads, o, params)
        return (optax.apply_updates(params, updates), o), value

    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=4, num_stages=2))
    (p1, _), loss = pstep(state, batch, weights)
    (p2, _), ref = jax.jit(step)(state, batch, weights)
    _assert_close(loss, ref)
    _assert_close(p1, p2)
    traced = pstep._executable((state, batch, weights), {}).traced
    kept = [traced.loss.vars[v].shape for v, s in zip(traced.loss.invars, traced.split_mask)
            if not s and not traced.diff_mask[traced.loss.invars.index(v)]]
    assert (8,) in kept


def test_given_submeshes_are_used_in_order():
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(6), 8)
    method = autopar.PipeshardParallel(num_micro_batches=2, submeshes=[(1, 2), (1, 4), (1, 2)], layers=4)
    plan = autopar.parallelize(make_step(opt), method=method).get_plan(state, batch)
    assert [s.submesh for s in plan.stages] == [(1, 2), (1, 4), (1, 2)]
    assert [len(s.device_ids) for s in plan.stages] == [2, 4, 2]


def test_saved_plan_is_reused_without_planning(tmp_path):
    """A pipeline plan saved as JSON and given back with plan= builds the same programs
    (no ILP solved) and the same result; a plan edited to another program is refused."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(7), 8)
    step = make_step(opt, closure=True)
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2)
    first = autopar.parallelize(step, method=method)
    (p1, _), l1 = first(state, batch)
    path = tmp_path / "pipe.json"
    first.plan.save(path)
    again = autopar.parallelize(step, plan=path)         # method="auto" follows the plan's kind
    (p2, _), l2 = again(state, batch)
    assert again.plan == first.plan
    _assert_close(l2, l1, rtol=1e-6)
    _assert_close(p2, p1, rtol=1e-6)
    exe1, exe2 = first._executable((state, batch), {}), again._executable((state, batch), {})
    assert [p.layouts[0].var_specs for p in exe2.programs] == [dict(p.layouts[0].var_specs) for p in exe1.programs]
    # the same plan on a step with another loss (stage markers add ops): refused
    with pytest.raises(autopar.PlanFileError, match="another program"):
        autopar.parallelize(make_step(opt, markers=True, closure=True), plan=path)(state, batch)
    # a plan for 8 devices on 4
    with pytest.raises(autopar.PlanFileError, match="device"):
        autopar.parallelize(step, plan=path, devices=jax.devices()[:4])(state, batch)


def test_plan_for_a_cluster_that_is_not_here():
    """make_plan prices a pipeline on an A100 cluster model from abstract inputs."""
    opt = optax.adamw(1e-3)
    state = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_state(opt))
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   make_batch(jax.random.PRNGKey(0), 16))
    plan = autopar.make_plan(make_step(opt, closure=True), state, batch, cluster="2x4:a100-80g",
                             method=autopar.PipeshardParallel(num_micro_batches="auto", num_stages=2))
    assert sum(len(s.device_ids) for s in plan.stages) == 8
    assert plan.num_micro_batches in (1, 2, 4, 8, 16)
    assert plan.pipeline.search.micro_batch_candidates == (1, 2, 4, 8, 16)
    assert plan.predicted_time_s > 0 and all(s.compute_s > 0 and s.memory_bytes > 0 for s in plan.stages)
    assert autopar.Plan.from_json(plan.to_json()) == plan


def _grouped_step(params, x):
    """A loss that mixes rows within groups of 4 (as GShard's MoE groups tokens): it
    cannot be traced on micro-batches of fewer than 4 rows."""
    def loss(p):
        h = x
        for w in p:
            g = jnp.tanh(h @ w).reshape(-1, 4, w.shape[1])
            h = (g - g.mean(axis=1, keepdims=True)).reshape(-1, w.shape[1])
        return jnp.mean(h ** 2)

    l, g = value_and_grad(loss)(params)
    return [w - 0.1 * gw for w, gw in zip(params, g)], l


def test_micro_batch_counts_the_step_cannot_be_traced_at_are_skipped():
    params = [jax.ShapeDtypeStruct((32, 32), jnp.float32) for _ in range(4)]
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    plan = autopar.make_plan(_grouped_step, params, x, cluster="1x2:a100-80g",
                             method=autopar.PipeshardParallel(num_micro_batches="auto"))
    assert plan.pipeline.search.micro_batch_candidates == (1, 2, 4, 8, 16)
    assert plan.num_micro_batches in (1, 2, 4)
    with pytest.raises(ValueError, match="cannot be traced on 8 micro-batches .batch 2 each.*fewer micro-batches"):
        autopar.make_plan(_grouped_step, params, x, cluster="1x2:a100-80g",
                          method=autopar.PipeshardParallel(num_micro_batches=8))


def test_clear_errors():
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(8), 6)
    with pytest.raises(ValueError, match="divisible by num_micro_batches=4"):
        autopar.parallelize(make_step(opt), method=autopar.PipeshardParallel(num_micro_batches=4))(state, batch)

    with pytest.raises(ValueError, match="num_micro_batches"):
        autopar.PipeshardParallel(num_micro_batches=0)
    with pytest.raises(ValueError, match="layers"):
        autopar.parallelize(make_step(opt), method=autopar.PipeshardParallel(num_stages=3, layers=2))(
            state, make_batch(jax.random.PRNGKey(8), 8))


def test_mark_stage_boundary_is_identity_outside_a_pipeline():
    x = jnp.arange(4.0)
    assert autopar.mark_stage_boundary() is None
    np.testing.assert_array_equal(autopar.mark_stage_boundary(x), x)
    a, b = autopar.mark_stage_boundary(x, x + 1)
    np.testing.assert_array_equal(b, x + 1)
    g = jax.grad(lambda v: jnp.sum(autopar.mark_stage_boundary(v) ** 2))(x)
    np.testing.assert_allclose(g, 2 * x)
    assert "autopar_stage_boundary" not in jax.jit(lambda v: autopar.mark_stage_boundary(v) * 2).lower(x).as_text()


@pytest.mark.parametrize("typed", [True, False])
def test_a_key_split_in_the_step_feeds_the_loss_and_comes_back(typed):
    """The step splits a PRNG key (typed or raw) kept beside the state: one half drops out
    embedding rows in the loss, the other is returned. The mask has the parameter's shape,
    so every micro-batch draws the same one and the pipeline equals one device; the key
    made before the gradient call reaches the step's outputs."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(9), 8)

    def dropped_loss(params, batch, key):
        keep = jax.random.bernoulli(key, 0.9, params["embed"].shape)
        return loss_fn({**params, "embed": jnp.where(keep, params["embed"] / 0.9, 0.0)}, batch)

    def step(state, batch, key):
        params, o = state
        key, sub = jax.random.split(key)
        loss, grads = jax.value_and_grad(dropped_loss)(params, batch, sub)
        updates, o = opt.update(grads, o, params)
        return (optax.apply_updates(params, updates), o), loss, key

    key = jax.random.key(0) if typed else jax.random.PRNGKey(0)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))
    (p1, _), l1, k1 = pstep(state, batch, key)
    (p2, _), l2, k2 = jax.jit(step)(state, batch, key)
    _assert_close(l1, l2)
    _assert_close(p1, p2)
    unwrap = jax.random.key_data if typed else (lambda k: k)
    np.testing.assert_array_equal(unwrap(k1), unwrap(k2))
