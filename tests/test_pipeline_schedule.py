"""Pipeline schedules: task orders, in-flight counts, timing, and the Gantt chart."""
import random

import pytest

from autopar.pipeline.gantt import draw, schedule_figure, timeline_bars
from autopar.pipeline.schedule import (issue_order, peak_in_flight, pipeline_latency_s, simulate,
                                       stage_orders)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_orders_run_every_pass_once_forward_first(schedule):
    for S in range(1, 6):
        for B in range(1, 7):
            orders = stage_orders(schedule, S, B)
            for s, order in enumerate(orders):
                assert sorted((t.kind, t.micro_batch) for t in order) == sorted(
                    [("F", m) for m in range(B)] + [("B", m) for m in range(B)])
                pos = {(t.kind, t.micro_batch): i for i, t in enumerate(order)}
                assert all(pos[("F", m)] < pos[("B", m)] for m in range(B))
                want = min(S - s, B) if schedule == "1f1b" else B
                assert peak_in_flight(order) == want


def test_simulation_respects_dependencies_and_matches_closed_form():
    rng = random.Random(0)
    for _ in range(50):
        S, B = rng.randint(1, 5), rng.randint(1, 8)
        schedule = rng.choice(["1f1b", "gpipe"])
        f = [rng.uniform(0.5, 2) for _ in range(S)]
        b = [rng.uniform(1, 4) for _ in range(S)]
        timed = simulate(stage_orders(schedule, S, B), f, b)
        end = {(t.task.stage, t.task.kind, t.task.micro_batch): t.end_s for t in timed}
        for t in timed:
            s, m = t.task.stage, t.task.micro_batch
            if t.task.kind == "F" and s > 0:
                assert t.start_s >= end[(s - 1, "F", m)] - 1e-12
            if t.task.kind == "B":
                assert t.start_s >= end[(s, "F", m)] - 1e-12
                if s < S - 1:
                    assert t.start_s >= end[(s + 1, "B", m)] - 1e-12
        for s in range(S):     # a stage never runs two tasks at once
            spans = sorted((t.start_s, t.end_s) for t in timed if t.task.stage == s)
            assert all(a[1] <= b2[0] + 1e-12 for a, b2 in zip(spans, spans[1:]))
    # equal stages: makespan = (S + B - 1) (f + b) = Alpa's sum + (B - 1) max
    for schedule in ("1f1b", "gpipe"):
        timed = simulate(stage_orders(schedule, 4, 6), [1.0] * 4, [2.0] * 4)
        assert max(t.end_s for t in timed) == pytest.approx(pipeline_latency_s([3.0] * 4, 6)) == 27.0


def test_issue_order_is_a_valid_sequential_order():
    for schedule in ("1f1b", "gpipe"):
        order = issue_order(stage_orders(schedule, 4, 5))
        done = set()
        for t in order:
            s, m = t.stage, t.micro_batch
            if t.kind == "F" and s > 0:
                assert (s - 1, "F", m) in done
            if t.kind == "B":
                assert (s, "F", m) in done and (s == 3 or (s + 1, "B", m) in done)
            done.add((s, t.kind, m))
        # per stage, the issue order keeps the schedule's own order
        for s, own in enumerate(stage_orders(schedule, 4, 5)):
            assert [t for t in order if t.stage == s] == own


def _two_stage_plan():
    from autopar.plan import PipelinePlan, Plan, StagePlan, TimelineTask

    timed = simulate(stage_orders("1f1b", 2, 3), [1.0, 2.0], [2.0, 4.0])
    stages = tuple(StagePlan((1, 4), ("x", "y"), tuple(range(4 * s, 4 * s + 4)), (), (), layer_range=(s, s + 1),
                             submesh=(1, 4)) for s in range(2))
    plan = Plan("pipeshard(1f1b, B=3)", "", {}, stages, num_micro_batches=3, schedule="1f1b",
                pipeline=PipelinePlan("1f1b", 3, 2, (0, 5, 9), 6 + 3 + 2 * 6, tuple(
                    TimelineTask(t.task.stage, t.task.kind, t.task.micro_batch, t.start_s, t.end_s) for t in timed)))
    return plan, timed


def test_gantt_draws_one_bar_per_task(tmp_path):
    from autopar.plan import Plan

    plan, timed = _two_stage_plan()
    path = tmp_path / "gantt.png"
    bars = draw(plan, str(path))
    assert len(bars) == len(timeline_bars(plan)) == 2 * 2 * 3
    assert max(b.start_s + b.duration_s for b in bars) == pytest.approx(max(t.end_s for t in timed))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="timeline"):
        timeline_bars(Plan("auto", "", {}, ()))


def test_gantt_leaves_the_users_backend_and_figures_alone(tmp_path):
    """In a notebook, switching the backend closes the user's figures and can end inline plots."""
    import matplotlib
    import matplotlib.pyplot as plt

    plan, _ = _two_stage_plan()
    before = matplotlib.get_backend()
    plt.switch_backend("svg")                  # the user's choice, not the Agg that saving a PNG uses
    try:
        users = plt.figure().number
        path = tmp_path / "gantt.pdf"
        draw(plan, str(path))
        assert path.read_bytes()[:5] == b"%PDF-"
        fig = schedule_figure(plan)
        assert (matplotlib.get_backend(), plt.get_fignums()) == ("svg", [users])
        assert isinstance(fig, matplotlib.figure.Figure)
        assert len(fig.axes[0].patches) == len(timeline_bars(plan))    # one bar per task
    finally:
        plt.close("all")
        plt.switch_backend(before)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_token_slice_orders_run_backwards_in_reverse_slice_order_without_deadlock(schedule):
    """Work items (micro-batch, slice): a micro-batch's backwards run last slice first (a
    slice's backward hands its context's cotangents to the earlier slices), and 1F1B warms
    up with enough forwards that every backward's forward has run on that stage."""
    rng = random.Random(1)
    for _ in range(40):
        S, B = rng.randint(1, 5), rng.randint(1, 4)
        slices = [rng.randint(1, 5) for _ in range(B)]
        orders = stage_orders(schedule, S, B, slices)
        timed = simulate(orders, [lambda m, i: 1.0 + i] * S, [lambda m, i: 2.0 + i] * S)   # raises on deadlock
        assert len(timed) == 2 * S * sum(slices)
        for s, order in enumerate(orders):
            backs = [t.item for t in order if t.kind == "B"]
            assert backs == [(m, i) for m in range(B) for i in reversed(range(slices[m]))]
            pos = {(t.kind, t.item): k for k, t in enumerate(order)}
            assert all(pos[("F", it)] < pos[("B", it)] for it in backs)
            limit = sum(slices) if schedule == "gpipe" else max(S - s, max(slices))
            assert peak_in_flight(order) <= limit
        end = {(t.task.stage, t.task.kind, t.task.item): t.end_s for t in timed}
        for t in timed:     # per-item costs: each task lasts what its callable says
            want = (1.0 if t.task.kind == "F" else 2.0) + t.task.slice
            assert t.end_s - t.start_s == pytest.approx(want)
            if t.task.kind == "B" and t.task.stage < S - 1:
                assert t.start_s >= end[(t.task.stage + 1, "B", t.task.item)] - 1e-12
