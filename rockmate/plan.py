"""The remat plan as plain data (JSON round-trip) and the infeasible-budget error."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sequence_dp import Leaf, Schedule, Split

PLAN_VERSION = 2  # 2: structural fingerprint of the op graph


class InfeasibleBudgetError(ValueError):
    """No schedule fits the memory budget; `min_budget_bytes` is the least that does."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        super().__init__(
            f"memory budget {budget_bytes} bytes ({budget_bytes / 1e6:.2f} MB) is below what any "
            f"rematerialization schedule can reach; the minimum is {min_budget_bytes} bytes "
            f"({min_budget_bytes / 1e6:.2f} MB). Raise the budget, cut the batch size, or mark "
            f"finer blocks with rockmate.block.")


@dataclass(frozen=True)
class BlockChoice:
    """What one block does: which of its ops' results are kept (indices within the block,
    or within the scan body), or plain autodiff (`keep_all`)."""

    start: int
    stop: int
    is_scan: bool
    kept: frozenset[int]
    keep_all: bool
    kept_bytes: int
    fwd_time_s: float
    bwd_time_s: float


@dataclass(frozen=True)
class RematPlan:
    """A rematerialization schedule and its predicted cost."""

    budget_bytes: int
    min_budget_bytes: int
    predicted_temp_bytes: int
    predicted_time_s: float
    blocks: tuple[BlockChoice, ...]
    schedule: Schedule
    fingerprint: str  # identifies the traced program the plan belongs to
    solve_time_s: float
    measured_temp_bytes: int | None = None  # XLA's temp bytes of the compiled program, if rockmate.remat measured it
    version: int = PLAN_VERSION

    def to_json(self) -> dict:
        """A JSON-serialisable dict."""
        return {
            "version": self.version,
            "budget_bytes": self.budget_bytes,
            "min_budget_bytes": self.min_budget_bytes,
            "predicted_temp_bytes": self.predicted_temp_bytes,
            "predicted_time_s": self.predicted_time_s,
            "fingerprint": self.fingerprint,
            "solve_time_s": self.solve_time_s,
            "measured_temp_bytes": self.measured_temp_bytes,
            "blocks": [
                {"start": b.start, "stop": b.stop, "is_scan": b.is_scan, "kept": sorted(b.kept),
                 "keep_all": b.keep_all, "kept_bytes": b.kept_bytes, "fwd_time_s": b.fwd_time_s,
                 "bwd_time_s": b.bwd_time_s}
                for b in self.blocks],
            "schedule": _tree_to_json(self.schedule),
        }

    @staticmethod
    def from_json(d: dict) -> "RematPlan":
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"remat plan version {d.get('version')!r} is not supported "
                             f"(expected {PLAN_VERSION}); re-plan with rockmate.plan_remat")
        blocks = tuple(BlockChoice(b["start"], b["stop"], b["is_scan"], frozenset(b["kept"]),
                                   b["keep_all"], b["kept_bytes"], b["fwd_time_s"], b["bwd_time_s"])
                       for b in d["blocks"])
        return RematPlan(d["budget_bytes"], d["min_budget_bytes"], d["predicted_temp_bytes"],
                         d["predicted_time_s"], blocks, _tree_from_json(d["schedule"]),
                         d["fingerprint"], d["solve_time_s"], d.get("measured_temp_bytes"))

    def summary(self) -> str:
        """One line per block: what it keeps and whether it is recomputed from a checkpoint."""
        lines = [f"rockmate plan: predicted temp {self.predicted_temp_bytes / 1e6:.1f} MB "
                 f"(budget {self.budget_bytes / 1e6:.1f} MB, minimum {self.min_budget_bytes / 1e6:.1f} MB"
                 + (f", measured {self.measured_temp_bytes / 1e6:.1f} MB" if self.measured_temp_bytes is not None else "")
                 + "), "
                 f"predicted fwd+bwd {self.predicted_time_s * 1e3:.1f} ms"]
        segs = _segments(self.schedule)
        for i, b in enumerate(self.blocks):
            mode = "autodiff (keep all)" if b.keep_all else f"keep {len(b.kept)} values ({b.kept_bytes / 1e6:.2f} MB)"
            where = f", recomputed inside segment {segs[i]}" if i in segs else ""
            kind = "scan" if b.is_scan else "ops"
            lines.append(f"  block {i} [{kind} {b.start}:{b.stop}]: {mode}{where}")
        return "\n".join(lines)


def _segments(tree: Schedule) -> dict[int, str]:
    out: dict[int, str] = {}

    def blocks_of(t):
        if isinstance(t, Leaf):
            return [t.block] + (blocks_of(t.rest) if t.rest is not None else [])
        return blocks_of(t.left) + blocks_of(t.right)

    def walk(t):
        if isinstance(t, Leaf):
            if t.rest is not None:
                walk(t.rest)
            return
        left = blocks_of(t.left)
        for b in left:
            out.setdefault(b, f"{left[0]}..{left[-1]}")
        walk(t.left)
        walk(t.right)
    walk(tree)
    return out


def _tree_to_json(t: Schedule) -> Any:
    if isinstance(t, Leaf):
        return {"leaf": t.block, "option": t.option,
                "rest": _tree_to_json(t.rest) if t.rest is not None else None}
    return {"split": t.at, "left": _tree_to_json(t.left), "right": _tree_to_json(t.right)}


def _tree_from_json(d: Any) -> Schedule:
    if "leaf" in d:
        return Leaf(d["leaf"], d["option"], _tree_from_json(d["rest"]) if d["rest"] is not None else None)
    return Split(d["split"], _tree_from_json(d["left"]), _tree_from_json(d["right"]))
