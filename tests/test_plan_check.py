"""Predictions against what XLA compiles (autopar.check): per-device memory within 15% and
collective bytes within 10% for single-stage and pipeline plans of the test models, and
remat inside a pipeline stage really shrinks what the compiled stage keeps."""
import jax
import optax
import pytest

import autopar
from autopar.check import check_executable, check_plan
from autopar.model_zoo import GPTConfig, gpt_abstract_setup, gpt_setup
from models import assert_tree_close
from pipeline_gpt import init_state, make_batch, make_step

WIDE = GPTConfig(vocab=64, seq=16, hidden=128, heads=4, layers=2, batch=64)
LM3 = GPTConfig(vocab=512, seq=64, hidden=128, heads=4, layers=3, batch=32)


def _assert_close_enough(checks):
    for c in checks:
        assert 0.85 <= c.memory_ratio <= 1.15, (c.stage, c.predicted_memory_bytes, c.compiled_memory_bytes)
        total = max(c.predicted_collective_bytes, c.compiled_collective_bytes)
        assert abs(c.predicted_collective_bytes - c.compiled_collective_bytes) <= 0.10 * total, \
            (c.stage, c.predicted_collectives, c.compiled_collectives)


@pytest.mark.parametrize("cfg,mesh", [(WIDE, (2, 4)), (WIDE, None), (LM3, None)], ids=["wide-2x4", "wide-auto", "lm3-auto"])
def test_single_stage_plans_predict_compiled_memory_and_collectives(cfg, mesh):
    step, state, batch = gpt_setup(cfg, optax.adamw(1e-3))
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=mesh), remat="none")
    checks = check_executable(pstep._executable((state, batch), {}), (state, batch))
    assert len(checks) == 1
    _assert_close_enough(checks)


@pytest.mark.parametrize("stages,B,schedule", [(2, 4, "1f1b"), (4, 2, "gpipe")])
def test_pipeline_plans_predict_compiled_memory_and_collectives(stages, B, schedule):
    opt = optax.adamw(1e-3)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(1), 16)
    pstep = autopar.parallelize(make_step(opt, closure=True), method=autopar.PipeshardParallel(
        num_micro_batches=B, num_stages=stages, schedule=schedule))
    checks = check_executable(pstep._executable((state, batch), {}), (state, batch))
    assert len(checks) == stages
    _assert_close_enough(checks)


def test_a_plan_for_a_cluster_that_is_not_here_is_checked_on_simulated_devices():
    """make_plan for 2x4 A100s from abstract inputs; check_plan builds the same stages on
    the 8 simulated CPU devices and compiles them, nothing materialised."""
    step, state, batch = gpt_abstract_setup(GPTConfig(vocab=64, seq=16, hidden=128, heads=4, layers=4, batch=32))
    plan = autopar.make_plan(step, state, batch, cluster="2x4:a100-80g",
                             method=autopar.PipeshardParallel(num_micro_batches=4, num_stages=2))
    checks = check_plan(step, state, batch, plan=plan)
    assert len(checks) == 2 and all(c.compiled_memory_bytes > 0 for c in checks)
    _assert_close_enough(checks)


def test_remat_inside_a_stage_shrinks_what_the_stage_keeps_and_keeps_numerics():
    """remat='full' checkpoints every layer's forward: each stage's compiled forward returns
    fewer residual bytes, the compiled stage memory drops and fits the budget it was planned
    under, and the step equals one device."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(2), 16)
    step = make_step(opt, closure=True)
    method = autopar.PipeshardParallel(num_micro_batches=4, num_stages=2, schedule="gpipe")
    plain = autopar.parallelize(step, method=method, remat="none")
    free = check_executable(plain._executable((state, batch), {}), (state, batch))
    budget = int(0.8 * max(c.compiled_memory_bytes for c in free))
    tight = autopar.parallelize(step, method=method, remat="full", memory_budget=budget)
    plan = tight.get_plan(state, batch)
    assert all(s.remat.mode == "full" and s.remat.recompute_s > 0 for s in plan.stages)
    exe_plain, exe_tight = plain._executable((state, batch), {}), tight._executable((state, batch), {})
    for s in range(2):
        kept = lambda exe: sum(x.size for x in exe.abstract_stage_args(s)[1][1])
        assert kept(exe_tight) < 0.5 * kept(exe_plain)
    checks = check_executable(exe_tight, (state, batch))
    for c, f in zip(checks, free):
        assert c.compiled_memory_bytes < f.compiled_memory_bytes
        assert c.compiled_memory_bytes <= budget * 1.05
    (p1, _), loss = tight(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)


def test_the_smallest_pipeline_budget_named_compiles_within_it():
    """An infeasible budget's error names the smallest budget the planner can meet; a
    pipeline planned at that budget compiles (every stage, XLA's accounting) within 15%
    of it, and runs equal to one device."""
    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(4), 8)
    step = make_step(opt, closure=True)
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2)
    with pytest.raises(autopar.MemoryBudgetError) as err:
        autopar.parallelize(step, method=method, memory_budget="1KB").get_plan(state, batch)
    budget = int(__import__("math").ceil(err.value.min_bytes))
    assert f"({budget} bytes)" in str(err.value)
    pstep = autopar.parallelize(step, method=method, memory_budget=budget)
    checks = check_executable(pstep._executable((state, batch), {}), (state, batch))
    assert all(c.predicted_memory_bytes <= budget for c in checks)
    assert all(c.compiled_memory_bytes <= 1.15 * budget for c in checks), [c.compiled_memory_bytes for c in checks]
    (p1, _), loss = pstep(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)


def test_rockmate_schedule_inside_a_stage_sits_between_no_remat_and_full():
    """remat='rockmate' (the pipeline's middle option) gives every stage rockmate's schedule
    of its layers: the compiled forwards keep fewer residuals than with no remat and more
    than checkpointing each layer, the compiled stages need less memory than without remat,
    the saved plan re-traces to the same schedule, and the step equals one device."""
    from autopar.cluster import Cluster

    opt = optax.sgd(0.1)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(2), 16)
    step = make_step(opt, closure=True)
    method = autopar.PipeshardParallel(num_micro_batches=4, num_stages=2, schedule="gpipe")
    kept = lambda exe, s: sum(x.size for x in exe.abstract_stage_args(s)[1][1])
    runs = {}
    for mode in ("none", "rockmate", "full"):
        plan = autopar.make_plan(step, state, batch, cluster=Cluster.from_devices(jax.devices()), method=method,
                                 remat=mode)
        assert all(s.remat.mode == mode for s in plan.stages)
        runs[mode] = autopar.parallelize(step, method=method, plan=plan)._executable((state, batch), {})
    for s in range(2):
        assert kept(runs["full"], s) < kept(runs["rockmate"], s) < 0.9 * kept(runs["none"], s)
    plain = check_executable(runs["none"], (state, batch))
    for c, f in zip(check_executable(runs["rockmate"], (state, batch)), plain):
        assert c.compiled_memory_bytes < 0.9 * f.compiled_memory_bytes
    (p1, _), loss = runs["rockmate"](state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)
    with pytest.raises(ValueError, match="single-program method"):
        autopar.make_plan(step, state, batch, cluster="1x8:a100-80g", method=autopar.ShardParallel(), remat="rockmate")
