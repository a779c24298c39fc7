"""Padded register tiles: an innermost row tile that does not divide its axis (6 rows of a
1024-row matmul). The loop covers ceil(n / tile) * tile rows; lowering pads local buffers,
guards stores to the output and clamps loads, and every such kernel must still match numpy."""
import random

import pytest

from search import Task, build
from search.backend import CBackend
from search.lower import lower
from search.measure import MeasureOptions, ProgramMeasurer
from search.mutation import mutate
from search.schedule import ScheduleError, replay, split_lengths
from search import sketch
from search.sketch import annotate, generate_sketches

FAST = MeasureOptions(repeats=1, min_time_s=0.0, rtol=1e-4)
TASKS = {
    "matmul_relu": Task.matmul(23, 32, 12, epilogue="relu"),
    "dense_gelu": Task.dense(20, 48, 16, "gelu"),
    "batch_matmul": Task.batch_matmul(3, 10, 16, 8),
    "conv2d_pad": Task.conv2d(1, 7, 7, 4, 16, 3, 3, 1, 1),
}


@pytest.mark.parametrize("extent, factors, lengths", [
    (1024, [171, 6], [1, 171, 6]),   # 1026 rows
    (1024, [3, 6], [57, 3, 6]),
    (50, [6], [9, 6]),
    (64, [4, 2], [8, 4, 2]),         # divides: no padding
])
def test_split_lengths_pad_by_less_than_the_innermost_tile(extent, factors, lengths):
    got = split_lengths(extent, factors)
    assert got == lengths
    total = 1
    for x in got:
        total *= x
    assert extent <= total < extent + factors[-1]


def test_padded_splits_that_would_waste_more_are_refused():
    with pytest.raises(ScheduleError, match="others must divide 171"):
        split_lengths(1024, [2, 6])  # 171 rows of 6 are not a multiple of 2
    with pytest.raises(ScheduleError, match="reduction axis"):
        split_lengths(1024, [6], padding=False)


def _padded_schedules(task, rng, n=6):
    """Random schedules of every sketch with padded row tiles forced on, plus mutants of them."""
    out = []
    for sk in generate_sketches(task.dag):
        for _ in range(n):
            s = annotate(sk, task.dag, rng)
            if s is not None:
                out.append(s)
    out += [m for m in (mutate(task.dag, rng.choice(out), rng) for _ in range(4)) if m is not None]
    return out


def _is_padded(task, steps) -> bool:
    state = replay(task.dag, steps)
    # a stage is padded when the extents of some axis' loops multiply to more than the axis
    for st in state.stages:
        for a in st.stage.axes:
            total = 1
            for _, p in st.prims:
                if p.axis == a.name:
                    total *= p.extent
            if total > a.extent:
                return True
    return False


@pytest.mark.parametrize("name", sorted(TASKS))
def test_padded_schedules_compile_and_match_numpy(name, monkeypatch):
    monkeypatch.setattr(sketch, "PADDED_TILE_PROB", 1.0)
    task = TASKS[name]
    scheds = _padded_schedules(task, random.Random(hash(name) % 997))
    padded = [s for s in scheds if _is_padded(task, s)]
    assert len(padded) >= 3, f"only {len(padded)} of {len(scheds)} sampled schedules are padded"
    m = ProgramMeasurer(task, opts=FAST)
    try:
        recs = m.measure(scheds)
    finally:
        m.close()
    bad = [(r.error, r.schedule) for r in recs if not r.ok]
    assert not bad, bad[0]


def test_padded_output_tile_guards_its_stores_and_clamps_its_loads():
    """A matmul written straight to the output with 6-row register tiles over 50 rows: the last
    tile's 4 extra rows are computed from a clamped row of A and never stored."""
    task = Task.matmul(50, 32, 20)
    steps = [{"kind": "split", "stage": "C", "iter": "i", "factors": [3, 6]},
             {"kind": "split", "stage": "C", "iter": "j", "factors": [16]},
             {"kind": "reorder", "stage": "C", "order": ["i.0", "j.0", "k", "i.1", "i.2", "j.1"]},
             {"kind": "annotate", "stage": "C", "iter": "i.0", "ann": "parallel"},
             {"kind": "annotate", "stage": "C", "iter": "j.1", "ann": "vectorize"}]
    prog = lower(replay(task.dag, steps))
    assert prog.args[-1].shape == (50, 32)  # the output is never padded
    src = CBackend().source(replay(task.dag, steps))
    assert "< 50) C[" in src and "< 49 ?" in src and "C_reg[" in src
    ins = task.random_inputs(1)
    out = build(task, steps)(*[ins[n] for n, _ in task.input_shapes])
    ref = task.reference(ins)
    assert abs(out - ref).max() <= 1e-4 * abs(ref).max()


def test_padded_local_tile_pads_its_buffer_and_the_consumer_reads_only_real_rows():
    """dense + gelu with 6-row tiles of C computed at the output's column tile: C's buffer holds
    the padded rows, the output stage (not padded) reads rows 0..19 only."""
    task = Task.dense(20, 64, 16, "gelu")
    steps = [{"kind": "split", "stage": "C", "iter": "i", "factors": [1, 4, 6]},
             {"kind": "split", "stage": "C", "iter": "j", "factors": [1, 1, 16]},
             {"kind": "split", "stage": "C", "iter": "k", "factors": [8]},
             {"kind": "reorder", "stage": "C",
              "order": ["i.0", "j.0", "i.1", "j.1", "k.0", "i.2", "j.2", "k.1", "i.3", "j.3"]},
             {"kind": "follow_split", "stage": "out", "iter": "i", "src": ["C", "i"], "n": 1},
             {"kind": "follow_split", "stage": "out", "iter": "j", "src": ["C", "j"], "n": 1},
             {"kind": "reorder", "stage": "out", "order": ["i.0", "j.0", "i.1", "j.1"]},
             {"kind": "annotate", "stage": "C", "iter": "j.3", "ann": "vectorize"},
             {"kind": "compute_at", "stage": "C", "target": "out", "iter": "j.0"}]
    prog = lower(replay(task.dag, steps))
    local = [n.buffer for n in _walk(prog.body) if type(n).__name__ == "Alloc"]
    assert [b.shape for b in local] == [(24, 16)]  # 4 tiles of 6 rows cover 20
    ins = task.random_inputs(2)
    out = build(task, steps)(*[ins[n] for n, _ in task.input_shapes])
    ref = task.reference(ins)
    assert abs(out - ref).max() <= 1e-4 * abs(ref).max()


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(getattr(n, "body", []))
