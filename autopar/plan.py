"""The Plan: serializable, versioned record of how a train step is split and what it should cost."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class PlanFileError(ValueError):
    """A plan file that cannot be read: missing, not JSON, or not an autopar plan."""


@dataclass(frozen=True)
class TensorPlan:
    """Layout of one argument, output or planned intermediate."""

    name: str                      # pytree path of an argument/output, or "op#N name" for intermediates
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[tuple[str, ...], ...]   # per dim: mesh axis names it is split over

    def spec_str(self) -> str:
        return "(" + ", ".join("*" if not a else "+".join(a) for a in self.spec) + ")"


@dataclass(frozen=True)
class StagePlan:
    """One SPMD program on one (sub)mesh."""

    mesh_shape: tuple[int, int]
    axis_names: tuple[str, str]
    device_ids: tuple[int, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    intermediates: tuple[TensorPlan, ...] = ()
    predicted_time_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    reshard_s: float = 0.0
    comm_bytes: float = 0.0
    memory_bytes: float = 0.0
    argument_bytes: float = 0.0
    collectives: dict[str, float] = field(default_factory=dict)   # kind -> predicted bytes
    solver_status: str = ""
    solve_time_s: float = 0.0
    layer_range: tuple[int, int] | None = None
    remat: dict[str, Any] | None = None


@dataclass(frozen=True)
class Plan:
    method: str
    signature: str
    cluster: dict[str, Any]
    stages: tuple[StagePlan, ...]
    memory_budget_bytes: float | None = None
    num_micro_batches: int = 1
    schedule: str | None = None
    pipeline: dict[str, Any] | None = None
    remat: dict[str, Any] | None = None
    planning_time_s: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def predicted_time_s(self) -> float:
        if self.pipeline and "predicted_step_s" in self.pipeline:
            return float(self.pipeline["predicted_step_s"])
        return float(sum(s.predicted_time_s for s in self.stages))

    # --- serialisation -------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFileError(f"not a plan: invalid JSON ({e})") from None
        if not isinstance(d, dict) or "schema_version" not in d or "stages" not in d:
            raise PlanFileError("not an autopar plan: missing 'schema_version' or 'stages'")
        if d["schema_version"] != SCHEMA_VERSION:
            raise PlanFileError(f"plan schema version {d['schema_version']} is not supported by this autopar "
                                f"(expects {SCHEMA_VERSION}); re-plan with this version or upgrade autopar")
        try:
            stages = tuple(_stage_from_dict(s) for s in d["stages"])
            d = {**d, "stages": stages}
            return Plan(**d)
        except (TypeError, KeyError, ValueError) as e:
            raise PlanFileError(f"corrupt autopar plan: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a failed write never leaves a half-written file over a good one."""
        path = Path(path)
        text = self.to_json()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @staticmethod
    def load(path: str | os.PathLike) -> "Plan":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
        try:
            return Plan.from_json(text)
        except PlanFileError as e:
            raise PlanFileError(f"{path}: {e}") from None

    # --- display ---------------------------------------------------------------------
    def summary(self, max_rows: int = 40) -> str:
        from autopar.plan_table import render_plan

        return render_plan(self, max_rows=max_rows)


def _tensor(d: dict) -> TensorPlan:
    return TensorPlan(d["name"], tuple(d["shape"]), d["dtype"], tuple(tuple(a) for a in d["spec"]))


def _stage_from_dict(s: dict) -> StagePlan:
    s = dict(s)
    for k in ("inputs", "outputs", "intermediates"):
        s[k] = tuple(_tensor(t) for t in s.get(k, ()))
    s["mesh_shape"] = tuple(s["mesh_shape"])
    s["axis_names"] = tuple(s["axis_names"])
    s["device_ids"] = tuple(s["device_ids"])
    if s.get("layer_range") is not None:
        s["layer_range"] = tuple(s["layer_range"])
    return StagePlan(**s)
