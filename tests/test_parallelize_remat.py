"""remat in parallelize: under a budget the plan cannot meet, the loss gets a rockmate
schedule, the result still equals one device, and the plan records the choice."""
import time

import jax
import pytest

import autopar
from autopar.model_zoo import GPTConfig, gpt_setup
from models import assert_tree_close

CFG = GPTConfig(vocab=32, seq=8, hidden=16, heads=2, layers=2, batch=8)


def _setup():
    import optax
    return gpt_setup(CFG, optax.sgd(1e-2))


def test_remat_auto_kicks_in_under_a_tight_budget_and_keeps_numerics():
    step, state, batch = _setup()
    method = autopar.ShardParallel(mesh_shape=(1, 8))
    free = autopar.parallelize(step, method=method, remat="none")
    st = free.get_plan(state, batch).stages[0]
    with pytest.raises(autopar.MemoryBudgetError) as err:   # the smallest footprint without remat
        autopar.parallelize(step, method=method, remat="none", memory_budget=1).get_plan(state, batch)
    budget = int(st.argument_bytes + 0.7 * (err.value.min_bytes - st.argument_bytes))
    tight = autopar.parallelize(step, method=method, memory_budget=budget, remat="auto")
    with pytest.warns(UserWarning) as record:
        plan = tight.get_plan(state, batch)
    assert plan.remat.applied == "rockmate"
    # the compiled SPMD program was measured; on this tiny model (nothing worth splitting
    # over the 8-way model axis) it cannot fit, and the plan and a warning say so
    ma = tight.lower(state, batch).compile().memory_analysis()[0]
    assert plan.remat.measured_temp_bytes == ma.temp_size_in_bytes
    assert plan.remat.measured_fits_budget == (ma.argument_size_in_bytes + ma.temp_size_in_bytes <= budget)
    if not plan.remat.measured_fits_budget:
        assert any("memory_analysis" in str(w.message) and "budget" in str(w.message) for w in record)
    assert plan.remat.predicted_temp_bytes < plan.remat.min_budget_bytes * 10
    (p1, _), loss = tight(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)
    # the rescheduled loss really is in the program: its checkpointed regions carry barriers
    assert "optimization_barrier" in tight.lower(state, batch).as_text()
    assert "optimization_barrier" not in free.lower(state, batch).as_text()
    assert "rockmate" in plan.summary()


def test_remat_none_and_roomy_budget_leave_the_step_alone():
    step, state, batch = _setup()
    roomy = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)), memory_budget="1GB")
    assert roomy.get_plan(state, batch).remat.applied.startswith("none")
    with pytest.raises(ValueError, match="remat"):
        autopar.parallelize(step, remat="sometimes")


def test_remat_auto_checks_the_compiled_program_and_replans_until_it_fits():
    """The budget is per device (arguments + XLA temp of the compiled SPMD step). rockmate's
    first schedule is planned from its own prediction; the compiled program is measured and,
    while over, re-planned with a tighter activation budget. Independent check: the
    program's own memory_analysis fits the budget, and the numbers equal one device."""
    import optax
    step, state, batch = gpt_setup(GPTConfig(vocab=32, seq=32, hidden=32, heads=2, layers=4, batch=16),
                                   optax.sgd(1e-2))
    method = autopar.ShardParallel(mesh_shape=(8, 1))
    free = autopar.parallelize(step, method=method, remat="none")
    ma_free = free.lower(state, batch).compile().memory_analysis()[0]
    budget = int(ma_free.argument_size_in_bytes + 0.6 * ma_free.temp_size_in_bytes)
    tight = autopar.parallelize(step, method=method, memory_budget=budget, remat="auto")
    t0 = time.perf_counter()
    plan = tight.get_plan(state, batch)
    wall = time.perf_counter() - t0
    assert 0.8 * wall <= plan.planning_time_s <= wall   # re-planning (with its compiles) is counted
    r = plan.remat
    assert r.applied == "rockmate" and r.measured_fits_budget, r
    ma = tight.lower(state, batch).compile().memory_analysis()[0]
    assert ma.argument_size_in_bytes + ma.temp_size_in_bytes <= budget
    assert ma.temp_size_in_bytes == r.measured_temp_bytes < 0.9 * ma_free.temp_size_in_bytes
    budgets = [a.activation_budget_bytes for a in r.attempts]
    assert len(budgets) == r.replans + 1 and budgets == sorted(budgets, reverse=True)
    assert r.replans >= 1  # the first schedule (planned from rockmate's prediction) measured over
    for a in r.attempts[:-1]:  # every re-plan was caused by a measured overshoot
        assert a.measured_argument_bytes + a.measured_temp_bytes > budget
    (p1, _), loss = tight(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    assert_tree_close(loss, ref)
    assert_tree_close(p1, p2)
