"""reshard_cost: closed-form alpha-beta costs, shortest-path properties on random layouts,
and the collectives XLA compiles for the same layout change."""
from __future__ import annotations

import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from autopar.cluster import LogicalMesh
from autopar.device_presets import PRESETS
from rockmate.graph.op_graph import TensorSpec
from autopar.resharding import reshard_cost
from autopar.sharding_spec import is_valid, to_partition_spec
from autopar.strategies.layouts import collective_s
from test_strategies import hlo_collectives

A0, A1, B0, B1 = 1e-5, 2e-5, 1e-9, 3e-9
MESH = LogicalMesh((2, 4), PRESETS["cpu"], (A0, A1), (B0, B1))
T = TensorSpec((64, 32), "float32")
FULL = 64 * 32 * 4


def test_same_layout_and_pure_slicing_are_free():
    assert reshard_cost(((0,), (1,)), ((0,), (1,)), T, MESH) == (0.0, ())
    assert reshard_cost(((), ()), ((0,), (1,)), T, MESH) == (0.0, ())
    assert reshard_cost(((0,), ()), ((0, 1), ()), T, MESH) == (0.0, ())


def test_closed_forms():
    cost, colls = reshard_cost(((0,), ()), ((), ()), T, MESH)  # all-gather over x
    assert [(c.kind, c.nbytes, c.axes) for c in colls] == [("all-gather", FULL, (0,))]
    assert cost == pytest.approx(A0 + 1 / 2 * FULL * B0)
    cost, colls = reshard_cost(((0, 1), ()), ((), ()), T, MESH)  # one all-gather over both
    assert [(c.kind, c.nbytes, c.axes) for c in colls] == [("all-gather", FULL, (0, 1))]
    assert cost == pytest.approx(max(A0, A1) + 7 / 8 * FULL * max(B0, B1))
    cost, colls = reshard_cost(((), (1,)), ((1,), ()), T, MESH)  # move y between dims
    assert [(c.kind, c.nbytes, c.axes) for c in colls] == [("all-to-all", FULL / 4, (1,))]
    assert cost == pytest.approx(A1 + 3 / 4 * FULL / 4 * B1)
    cost, colls = reshard_cost(((0, 1), ()), ((0,), ()), T, MESH)  # drop the minor axis
    assert [(c.kind, c.nbytes, c.axes) for c in colls] == [("all-gather", FULL / 2, (1,))]
    assert cost == pytest.approx(A1 + 3 / 4 * FULL / 2 * B1)
    # dropping the major axis of S01 while keeping y: gather y then... or gather both and slice
    cost, colls = reshard_cost(((0, 1), ()), ((1,), ()), T, MESH)
    assert cost <= max(A0, A1) + 7 / 8 * FULL * max(B0, B1) + 1e-15


def _layouts(shape, mesh_shape):
    out = set()
    for choice in itertools.product([None, *range(len(shape))], repeat=2):
        for order in ((0, 1), (1, 0)):
            spec = [() for _ in shape]
            for a in order:
                if choice[a] is not None:
                    spec[choice[a]] += (a,)
            if is_valid(shape, tuple(spec), mesh_shape):
                out.add(tuple(spec))
    return sorted(out)


def test_random_pairs_are_shortest_paths():
    """Cost equals its collectives' cost, is zero exactly for pure slicing, never exceeds
    gather-everything-then-slice, and obeys the triangle inequality."""
    rng = random.Random(0)
    t = TensorSpec((8, 16, 4), "float32")
    layouts = _layouts(t.shape, MESH.shape)
    assert len(layouts) > 15
    for _ in range(150):
        a, b, c = (rng.choice(layouts) for _ in range(3))
        cost, colls = reshard_cost(a, b, t, MESH)
        assert cost == pytest.approx(sum(collective_s(MESH, x) for x in colls))
        pure_slice = all(db[:len(da)] == da for da, db in zip(a, b))
        assert (cost == 0.0) == pure_slice
        src_axes = tuple(sorted(x for axes in a for x in axes))
        gather_all = MESH.all_gather_s(t.nbytes, src_axes) if src_axes else 0.0
        assert cost <= gather_all * (1 + 1e-9)
        via = reshard_cost(a, c, t, MESH)[0] + reshard_cost(c, b, t, MESH)[0]
        assert cost <= via * (1 + 1e-9)


def test_bad_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="not valid for shape"):
        reshard_cost(((0,), ()), ((), (0, 1)), TensorSpec((64, 6), "float32"), MESH)
    with pytest.raises(ValueError, match="rank"):
        reshard_cost(((0,),), ((),), T, MESH)


@pytest.mark.parametrize("src,dst", [
    (((0,), ()), ((), ())),
    (((0, 1), ()), ((), ())),
    (((), (1,)), ((1,), ())),
    (((0,), ()), ((), (0,))),
    (((0,), (1,)), ((0, 1), ())),
])
def test_predicted_collectives_match_compiled_hlo(src, dst):
    jmesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.asarray(np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    f = jax.jit(lambda a: a, in_shardings=NamedSharding(jmesh, to_partition_spec(src)),
                out_shardings=NamedSharding(jmesh, to_partition_spec(dst)))
    got = hlo_collectives(f.lower(x).compile().as_text())
    _, colls = reshard_cost(src, dst, T, MESH)
    assert [(c.kind, c.nbytes) for c in colls] == got


def test_closed_form_gathers_agree_with_the_full_search():
    """The no-move fast path gives the same cost as the shortest-path search."""
    from autopar.resharding import _gather_only, _shortest_paths, _signature

    rng = random.Random(1)
    for shape in [(8, 16, 4), (2, 12), (16, 8, 8, 2)]:
        t = TensorSpec(shape, "float32")
        layouts = _layouts(shape, MESH.shape)
        checked = 0
        for _ in range(400):
            a, b = rng.choice(layouts), rng.choice(layouts)
            if a == b or all(db[:len(da)] == da for da, db in zip(a, b)):
                continue
            fast = _gather_only(a, b, shape, 4, MESH, MESH.shape)
            if fast is None:
                continue
            slow = _shortest_paths(a, *_signature(shape, 4, MESH.shape), MESH, MESH.shape)[b]
            assert fast[0] == pytest.approx(slow[0], rel=1e-9), (a, b, fast, slow)
            checked += 1
        assert checked > 20


def test_a_shared_table_answers_as_a_fresh_search():
    """A planning run keeps one shortest-path table per source layout, divisibility and size
    (per mesh); answers through it equal fresh searches, also for another shape with the same
    divisibility and bytes, and far fewer tables than pairs are built."""
    rng = random.Random(2)
    tables: dict = {}
    pairs = 0
    for shape in [(8, 16, 4), (16, 8, 4), (16, 8, 8, 2)]:
        t = TensorSpec(shape, "float32")
        layouts = _layouts(shape, MESH.shape)
        for _ in range(300):
            a, b = rng.choice(layouts), rng.choice(layouts)
            assert reshard_cost(a, b, t, MESH, tables) == reshard_cost(a, b, t, MESH)
            pairs += 1
    assert 0 < len(tables) < pairs / 5
