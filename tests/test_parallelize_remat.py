"""remat in parallelize: under a budget the plan cannot meet, the loss gets a rockmate
schedule, the result still equals one device, and the plan records the choice."""
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
    plan = tight.get_plan(state, batch)
    assert plan.remat["applied"] == "rockmate"
    assert plan.remat["predicted_temp_bytes"] < plan.remat["min_budget_bytes"] * 10
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
    assert roomy.get_plan(state, batch).remat["applied"].startswith("none")
    with pytest.raises(ValueError, match="remat"):
        autopar.parallelize(step, remat="sometimes")
