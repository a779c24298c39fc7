"""A per-device memory budget is respected by the compiled program, and an impossible one
gives an error that names the smallest budget that fits."""
import jax
import pytest

import autopar
from models import make


def _replicated_state_bytes(state):
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(state))


def test_budget_below_replicated_footprint_is_met_by_the_compiled_program():
    step, state, batch = make("mlp", "adamw")
    replicated = _replicated_state_bytes(state)
    budget = replicated // 2
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)), memory_budget=budget, remat="none")
    plan = pstep.get_plan(state, batch)
    assert plan.stages[0].memory_bytes <= budget
    mem = pstep.lower(state, batch).compile().memory_analysis()[0]
    assert mem.argument_size_in_bytes <= budget
    # without a budget the tiny model would just be replicated (and exceed this budget)
    free = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)))
    free_args = free.lower(state, batch).compile().memory_analysis()[0].argument_size_in_bytes
    assert free_args > budget


def test_impossible_budget_reports_the_smallest_budget_that_fits():
    step, state, batch = make("mlp", "adamw")
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)), memory_budget="1KB", remat="none")
    with pytest.raises(autopar.MemoryBudgetError) as err:
        pstep.get_plan(state, batch)
    minimum = err.value.min_bytes
    assert "smallest budget" in str(err.value) and minimum > 1000
    # ... and that budget does fit
    ok = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)), memory_budget=int(minimum * 1.001) + 1,
                             remat="none")
    assert ok.get_plan(state, batch).stages[0].memory_bytes <= minimum * 1.001 + 1


def test_bad_inputs_get_clear_errors():
    step, state, batch = make("mlp", "sgd")
    with pytest.raises(ValueError, match="memory"):
        autopar.parallelize(step, memory_budget="twelve gigs")
    with pytest.raises(autopar.MeshDivisibilityError, match="leading dimension 10"):
        odd = jax.tree_util.tree_map(lambda x: x[:10], batch)
        autopar.parallelize(step, method=autopar.DataParallel()).get_plan(state, odd)
    with pytest.raises(autopar.MeshDivisibilityError, match="tp"):
        autopar.parallelize(step, method=autopar.Megatron(tp=3)).get_plan(state, batch)
    with pytest.raises(ValueError, match="unknown method"):
        autopar.parallelize(step, method="fastest")


def test_impossible_budget_with_remat_names_the_minimum_too():
    from autopar.model_zoo import GPTConfig, gpt_setup

    step, state, batch = gpt_setup(GPTConfig(vocab=32, seq=8, hidden=16, heads=2, layers=1, batch=8))
    pstep = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1, 8)), memory_budget="1KB")
    with pytest.raises(autopar.MemoryBudgetError, match="smallest budget") as err:
        pstep.get_plan(state, batch)
    assert err.value.min_bytes > 1000
