"""tune/build end to end on tiny tasks, the tuning DB as the record of every measurement,
interrupted runs, warm starts, and the task scheduler's gradient."""
import math

import numpy as np
import pytest

import search
from search import Task, build, tune, tune_tasks
from search.database import TuningDB
from search.evolution import schedule_key
from search.measure import MeasureOptions
from search.task_scheduler import TaskProgress, task_gradient

FAST = MeasureOptions(repeats=2, min_time_s=0.0)


@pytest.mark.parametrize("policy", ["evolutionary", "random"])
def test_tune_stores_every_measurement_and_builds_the_best(tmp_path, policy):
    task = Task.matmul(32, 32, 16)
    db = str(tmp_path / "db.sqlite")
    res = tune(task, trials=8, db=db, policy=policy, batch_size=4, measure_options=FAST)
    assert res.trials == 8
    with TuningDB(db) as d:
        stored = d.records(task.workload_key)
        assert sorted(r.to_json() for r in stored) == sorted(r.to_json() for r in res.records)
    ok = [min(r.latencies_s) for r in res.records if r.ok]
    assert res.best_latency_s == min(ok)
    assert [h[1] for h in res.history] == sorted((h[1] for h in res.history), reverse=True)
    ins = task.random_inputs(7)
    np.testing.assert_allclose(build(task, res.best_schedule)(ins["A"], ins["B"]),
                               ins["A"].astype(np.float64) @ ins["B"], rtol=1e-4, atol=1e-4)
    assert search.best_schedule(task, db=db) == min(res.records, key=lambda r: min(r.latencies_s or [1e9])).schedule


def test_interrupted_tuning_keeps_measured_batches(tmp_path):
    task = Task.softmax(8, 32)
    db = str(tmp_path / "db.sqlite")

    def stop(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune(task, trials=12, db=db, batch_size=4, measure_options=FAST, callback=stop)
    with TuningDB(db) as d:
        assert len(d.records(task.workload_key)) == 4


def test_warm_start_does_not_remeasure_known_schedules(tmp_path):
    task = Task.layernorm(8, 16)
    db = str(tmp_path / "db.sqlite")
    first = tune(task, trials=8, db=db, batch_size=8, measure_options=FAST, policy="random")
    second = tune(task, trials=8, db=db, batch_size=8, measure_options=FAST)
    old = {schedule_key(r.schedule) for r in first.records}
    assert not old & {schedule_key(r.schedule) for r in second.records}
    with TuningDB(db) as d:
        assert len(d.records(task.workload_key)) == 16


def test_bad_arguments_are_refused(tmp_path):
    task = Task.matmul(8, 8, 8)
    with pytest.raises(ValueError, match="target"):
        tune(task, target="gpu", db=str(tmp_path / "x.sqlite"))
    with pytest.raises(ValueError, match="positive"):
        tune(task, trials=0, db=str(tmp_path / "x.sqlite"))
    with pytest.raises(ValueError, match="policy"):
        tune(task, trials=1, policy="annealing", db=str(tmp_path / "x.sqlite"))
    with pytest.raises(ValueError, match="no schedule"):
        build(task, None)


def test_task_gradient_closed_form():
    untuned = TaskProgress(1.0, 100, 0, (), "matmul")
    a = TaskProgress(2.0, 1000, 8, (4.0, 2.0), "matmul")  # 2 rounds of 4 trials
    b = TaskProgress(1.0, 1000, 8, (1.0, 1.0), "matmul")
    tasks = [untuned, a, b]
    assert task_gradient(0, tasks) == -math.inf
    # a: backward = -g/t = -2/8, v_best = 1000/1 (task b), optimistic = min(-2/8, 2*1000/1000 - 2 = 0)
    assert task_gradient(1, tasks, alpha=0.2, beta=2.0) == pytest.approx(2.0 * (0.2 * -0.25 + 0.8 * -0.25))
    # b: already at the best throughput; optimistic = min(-1/8, 2 - 1) = -1/8
    assert task_gradient(2, tasks, alpha=0.2, beta=2.0) == pytest.approx(0.2 * -0.125 + 0.8 * -0.125)
    c = TaskProgress(1.0, 1000, 16, (8.0, 6.0, 5.0, 4.0), "softmax")
    # backward over a window of 3 rounds of 4 trials: (4 - 8) / 12
    assert task_gradient(0, [c], alpha=1.0, window=3) == pytest.approx(-4 / 12)


def test_tune_tasks_spends_one_budget_over_all_tasks(tmp_path):
    tasks = [Task.matmul(16, 16, 16), Task.softmax(8, 16)]
    out = tune_tasks(tasks, trials=12, batch_size=4, db=str(tmp_path / "db.sqlite"), measure_options=FAST, eps=0.0)
    counts = [out[t.workload_key].trials for t in tasks]
    assert sum(counts) == 12 and min(counts) >= 4
    assert all(out[t.workload_key].best_schedule is not None for t in tasks)


def test_tuning_and_building_leave_no_build_files_behind(tmp_path, monkeypatch):
    """Build directories are temporary: after tune() and build() the temp dir holds nothing of
    ours, and the built kernel still runs (its library stays mapped)."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    task = Task.matmul(16, 16, 8)
    res = tune(task, trials=4, db=str(tmp_path / "db.sqlite"), batch_size=4, measure_options=FAST,
               policy="random")
    kernel = build(task, res.best_schedule)
    assert list(scratch.iterdir()) == []
    ins = task.random_inputs(3)
    out = kernel(*[ins[n] for n, _ in task.input_shapes])
    assert np.allclose(out, task.reference(ins), rtol=1e-4, atol=1e-5)
