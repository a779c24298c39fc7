"""Gantt chart of a pipeline schedule from a plan's predicted costs (matplotlib)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.plan import Plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Bar:
    """One task on the chart: stage row, start and length in seconds, F/B, micro-batch."""

    stage: int
    start_s: float
    duration_s: float
    kind: str
    micro_batch: int
    slice: int = 0


def timeline_bars(plan: Plan) -> list[Bar]:
    """The bars of a pipeline plan's simulated timeline."""
    if plan.pipeline is None:
        raise ValueError("this plan has no pipeline timeline (not a PipeshardParallel plan)")
    return [Bar(t.stage, t.start_s, t.end_s - t.start_s, t.kind, t.micro_batch, t.slice) for t in plan.pipeline.timeline]


def schedule_figure(plan: Plan) -> Figure:
    """The schedule drawn stage by stage over time, on a Figure made without pyplot: the
    matplotlib backend and the open pyplot figures stay as they were (a notebook shows it)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    bars = timeline_bars(plan)
    S = len(plan.stages)
    B = plan.pipeline.num_micro_batches
    sliced = plan.pipeline.token_slices
    fig = Figure(figsize=(10, 0.6 * S + 1.5), layout="tight")
    ax = fig.subplots()
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for b in bars:
        ax.barh(b.stage, b.duration_s, left=b.start_s, color=colors[b.kind], edgecolor="black", height=0.8)
        if len(bars) <= 64 * S:
            label = f"{b.kind}{b.micro_batch}" + (f".{b.slice}" if sliced is not None else "")
            ax.text(b.start_s + b.duration_s / 2, b.stage, label,
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(S))
    ax.set_yticklabels([f"stage {s} ({'x'.join(map(str, st.submesh or st.mesh_shape))}, "
                        f"layers {st.layer_range[0]}..{st.layer_range[1] - 1})" for s, st in enumerate(plan.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted time (s)")
    what = f"{B} micro-batches" if sliced is None else \
        f"{len(sliced.slices)} micro-batches in {sliced.num_items} token slices"
    ax.set_title(f"{plan.pipeline.schedule} schedule, {what}, predicted {plan.predicted_time_s:.3g} s")
    ax.legend([Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], ["forward", "backward"], loc="upper right")
    return fig


def draw(plan: Plan, path: str) -> list[Bar]:
    """Write `schedule_figure(plan)` to an image file (PNG, SVG, PDF); returns the bars drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = schedule_figure(plan)
    FigureCanvasAgg(fig)
    fig.savefig(path)
    return timeline_bars(plan)
