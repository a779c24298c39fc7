"""The compiled program does what the planner decided: collective kinds and bytes read from
the partitioned HLO agree with the plan's prediction."""
import pytest

import autopar
from autopar.hlo_collectives import bytes_by_kind, parse_collectives
import optax

from autopar.model_zoo import GPTConfig, gpt_setup

# Models big enough that the plans communicate (tiny ones are best run replicated).
WIDE_GPT = GPTConfig(vocab=64, seq=16, hidden=128, heads=4, layers=2, batch=64)
CASES = [
    ("gpt", autopar.ShardParallel(mesh_shape=(2, 4))),
    ("gpt", autopar.ShardParallel(mesh_shape=(1, 8))),
    ("gpt", autopar.DataParallel()),
    ("gpt", autopar.ZeRO3()),
]


def _setup(model):
    return gpt_setup(WIDE_GPT, optax.adamw(1e-2))


def _kinds(by_kind):
    """XLA's CPU backend emits all-reduce + slice where GPUs/TPUs emit reduce-scatter."""
    out = dict(by_kind)
    out["all-reduce"] = out.get("all-reduce", 0.0) + out.pop("reduce-scatter", 0.0)
    return out


@pytest.mark.parametrize("model,method", CASES, ids=[f"{m}-{getattr(x, 'name', '')}" for m, x in CASES])
def test_compiled_collectives_match_plan(model, method):
    step, state, batch = _setup(model)
    pstep = autopar.parallelize(step, method=method)
    plan = pstep.get_plan(state, batch)
    predicted = _kinds(plan.stages[0].collectives)
    compiled = _kinds(bytes_by_kind(pstep.lower(state, batch).compile().as_text()))
    total_pred, total_hlo = sum(predicted.values()), sum(compiled.values())
    assert total_pred > 0 and total_hlo > 0
    assert abs(total_hlo - total_pred) <= 0.10 * total_pred, (predicted, compiled)
    for kind in set(predicted) | set(compiled):   # and kind by kind
        assert abs(compiled.get(kind, 0.0) - predicted.get(kind, 0.0)) <= 0.10 * total_pred, (predicted, compiled)


def test_data_parallel_gradient_all_reduce_bytes_equal_parameter_bytes():
    """Independent of the planner: DP on a GPT must all-reduce exactly one copy of every gradient."""
    import jax

    step, state, batch = gpt_setup(WIDE_GPT, optax.sgd(1e-2))
    pstep = autopar.parallelize(step, method=autopar.DataParallel())
    hlo = pstep.lower(state, batch).compile().as_text()
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state[0]))
    ar = sum(c.nbytes for c in parse_collectives(hlo) if c.kind == "all-reduce" and c.group_size == 8)
    assert param_bytes <= ar <= param_bytes * 1.01 + 64


def test_hlo_parser_reads_tuple_async_and_iota_groups():
    text = """
  %all-reduce.3 = (f32[32]{0}, /*index=1*/f32[4,8]{1,0}) all-reduce(%a, %b), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ag = f32[16,8]{1,0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}
  %rs = bf16[2,8]{1,0} reduce-scatter(%q), replica_groups=mesh['x'=2,'y'=4] {'y'}, dimensions={0}
  %ag.7 = f32[32,384]{0,1} all-gather(%f), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={1}
"""
    got = parse_collectives(text)
    assert [(c.kind, c.nbytes, c.group_size) for c in got] == [
        ("all-reduce", 32 * 4 + 32 * 4, 4), ("all-gather", 16 * 8 * 4, 4), ("reduce-scatter", 2 * 8 * 2 * 4, 4),
        ("all-gather", 32 * 384 * 4, 2)]


def test_layouts_offered_for_variables_keep_mesh_axes_in_order():
    """A transposed tiling would make XLA split a two-axis collective into one per axis."""
    from autopar.sharding_spec import all_layouts, is_transposed

    layouts = all_layouts((128, 384), (2, 4))
    assert ((0,), (1,)) in layouts and ((1,), (0,)) not in layouts
    assert not any(is_transposed(l) for l in layouts)
    assert is_transposed(((), (1,), (0,))) and not is_transposed(((0, 1), ()))
