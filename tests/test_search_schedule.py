"""Schedules are step lists: JSON round-trips replay to the same program; bad steps are refused."""
import json
import random

import pytest

from search import Task
from search.codegen_c import to_c_source
from search.lower import lower
from search.schedule import ScheduleError, replay, steps_from_json, steps_to_json
from search.sketch import generate_sketches, sample_schedules

TASKS = [Task.matmul(32, 32, 16), Task.dense(16, 32, 8, "relu"), Task.batch_matmul(2, 8, 8, 4),
         Task.softmax(8, 64), Task.layernorm(8, 32), Task.conv2d(1, 5, 5, 4, 4, 3, 3, 1, 1)]


@pytest.mark.parametrize("task", TASKS, ids=str)
def test_json_round_trip_replays_to_same_program(task):
    for steps in sample_schedules(generate_sketches(task.dag), task.dag, 6, random.Random(1)):
        text = steps_to_json(steps)
        back = steps_from_json(json.loads(json.dumps(text)))
        assert back == steps
        assert replay(task.dag, back) == replay(task.dag, steps)
        assert to_c_source(lower(replay(task.dag, back))) == to_c_source(lower(replay(task.dag, steps)))


def test_split_records_tile_lengths_and_loop_extents():
    t = Task.matmul(64, 48, 32)
    st = replay(t.dag, [{"kind": "split", "stage": "C", "iter": "i", "factors": [4, 2]}]).stage("C")
    assert [l.name for l in st.loops] == ["i.0", "i.1", "i.2", "j", "k"]
    assert [st.prim(n).extent for n in ("i.0", "i.1", "i.2")] == [8, 4, 2]
    assert [st.prim(n).stride for n in ("i.0", "i.1", "i.2")] == [8, 2, 1]


@pytest.mark.parametrize("step, msg", [
    ({"kind": "split", "stage": "C", "iter": "k", "factors": [5]}, "reduction axis cannot be padded"),
    ({"kind": "split", "stage": "C", "iter": "i", "factors": [3, 5]}, "others must divide 13"),
    ({"kind": "split", "stage": "C", "iter": "q", "factors": [2]}, "no loop"),
    ({"kind": "fuse", "stage": "C", "iters": ["i", "k"]}, "not adjacent"),
    ({"kind": "fuse", "stage": "C", "iters": ["j", "k"]}, "spatial and reduction"),
    ({"kind": "compute_inline", "stage": "C"}, "only element-wise"),
    ({"kind": "annotate", "stage": "C", "iter": "i", "ann": "gpu"}, "unknown annotation"),
    ({"kind": "tile", "stage": "C"}, "unknown step kind"),
    ({"kind": "split", "stage": "D", "iter": "i", "factors": [2]}, "no stage"),
    ({"kind": "cache_read", "stage": "C", "tensor": "Z"}, "not an input"),
])
def test_bad_steps_are_refused_with_a_reason(step, msg):
    with pytest.raises(ScheduleError, match=msg):
        replay(Task.matmul(64, 48, 32).dag, [step])


def test_invalid_annotations_fail_at_lowering():
    t = Task.matmul(64, 48, 32)
    with pytest.raises(ScheduleError, match="vectorized"):
        lower(replay(t.dag, [{"kind": "annotate", "stage": "C", "iter": "i", "ann": "vectorize"}]))
    with pytest.raises(ScheduleError, match="parallel"):
        lower(replay(t.dag, [{"kind": "annotate", "stage": "C", "iter": "j", "ann": "parallel"}]))


def test_cache_write_and_compute_at_give_a_tile_buffer():
    t = Task.matmul(64, 64, 32)
    steps = [{"kind": "cache_write", "stage": "C"},
             {"kind": "split", "stage": "C", "iter": "i", "factors": [8]},
             {"kind": "split", "stage": "C", "iter": "j", "factors": [16]},
             {"kind": "reorder", "stage": "C", "order": ["i.0", "j.0", "i.1", "j.1"]},
             {"kind": "compute_at", "stage": "C.local", "target": "C", "iter": "j.0"}]
    src = to_c_source(lower(replay(t.dag, steps)))
    assert "float C_local[128]" in src  # 8 x 16 tile


def test_cache_read_packs_the_region_a_tile_reads_into_a_panel():
    """B.read computed at the j-tile loop holds K x 16 of B (the panel that tile reads), gets
    rows of 16 contiguous floats, and the kernel still computes A @ B."""
    import numpy as np

    from search import build

    t = Task.matmul(32, 64, 24)
    steps = [{"kind": "cache_read", "stage": "C", "tensor": "B"},
             {"kind": "split", "stage": "C", "iter": "j", "factors": [16]},
             {"kind": "reorder", "stage": "C", "order": ["j.0", "i", "k", "j.1"]},
             {"kind": "compute_at", "stage": "B.read", "target": "C", "iter": "j.0"}]
    k = build(t, steps)
    assert "float B_read[384]" in k.source  # K=24 rows of the 16 columns of one j tile
    assert "B_read[((v1_k * 16) + v1_j_1)]" in k.source  # the tile reads the panel row by row
    a, b = (np.random.default_rng(2).standard_normal(s).astype(np.float32) for _, s in t.input_shapes)
    np.testing.assert_allclose(k(a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ScheduleError, match="does not read 'B'"):  # C reads B.read now
        replay(t.dag, steps[:1] + steps[:1])
    with pytest.raises(ScheduleError, match="before its loops"):
        replay(t.dag, steps[1:2] + steps[:1])


def test_steps_from_json_rejects_non_schedules():
    with pytest.raises(ScheduleError):
        steps_from_json('{"kind": "split"}')
