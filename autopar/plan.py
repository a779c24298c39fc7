"""The Plan: serializable, versioned record of how a train step is split and what it should cost.

Everything in it is typed data (frozen dataclasses), saved as JSON and read back into the
same classes; nothing is recovered by parsing display strings.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2

AxisNames = tuple[tuple[str, ...], ...]     # per tensor dim: the mesh axes it is split over


class PlanFileError(ValueError):
    """A plan that cannot be used: missing, not JSON, not an autopar plan, or made for
    other inputs or devices."""


@dataclass(frozen=True)
class TensorPlan:
    """Layout of one argument, output or planned intermediate. An intermediate names the
    op that produces it (`op`, `output`: index into its graph's ops and outputs)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: AxisNames
    op: int | None = None
    output: int | None = None

    def spec_str(self) -> str:
        return "(" + ", ".join("*" if not a else "+".join(a) for a in self.spec) + ")"


@dataclass(frozen=True)
class RematAttempt:
    """One schedule tried while fitting a compiled step under the memory budget."""

    activation_budget_bytes: float
    measured_argument_bytes: int
    measured_temp_bytes: int


@dataclass(frozen=True)
class RematInfo:
    """Rematerialization of a single-stage plan: what was asked, what was applied, what
    rockmate predicted and what the compiled program measured."""

    mode: str                                   # "auto" | "none" | "full"
    applied: str                                # "rockmate" or why not
    activation_budget_bytes: float | None = None
    predicted_temp_bytes: float | None = None
    min_budget_bytes: float | None = None
    predicted_fwd_bwd_s: float | None = None
    blocks: int | None = None
    batch_shards: int | None = None
    summary: str = ""
    measured_argument_bytes: int | None = None
    measured_temp_bytes: int | None = None
    measured_fits_budget: bool | None = None
    replans: int = 0
    attempts: tuple[RematAttempt, ...] = ()


@dataclass(frozen=True)
class LayerLayout:
    """The layouts of one layer of a pipeline stage: every value of its train graph
    (forward + backward of one micro-batch), by var id, as the ILP chose them."""

    index: int                                  # layer index in the loss
    key: str                                    # content key of the layer's train graph
    remat: str                                  # "none" | "full"
    var_specs: tuple[AxisNames | None, ...]     # by train-graph var id; None: not planned
    out_specs: tuple[AxisNames, ...]            # per train-graph output, as returned
    predicted_time_s: float = 0.0


@dataclass(frozen=True)
class StageRemat:
    """Rematerialization inside a pipeline stage."""

    mode: str                                   # "none" | "full" (each layer's forward recomputed)
    recompute_s: float = 0.0                    # forward time added to the backward, per micro-batch
    saved_bytes: float = 0.0                    # activation bytes per micro-batch it saves, per device


@dataclass(frozen=True)
class KernelUse:
    """What serves one op of a stage: a tuned kernel (`used`) or XLA's own code, and the
    head-to-head times of its local op on one device of the planning machine."""

    op: int                                     # op index in the stage's program (pipelines: in its layer's)
    workload_key: str                           # the search task (tuning DB key)
    used: bool
    reason: str
    tuned_s: float | None = None
    xla_s: float | None = None
    layer: int | None = None                    # pipelines: the layer (index in the loss) the op belongs to


@dataclass(frozen=True)
class KernelTask:
    """A kernel-search task of a stage's ops at one device's local shapes: what
    `autopar tune --plan` tunes and `kernels="tuned"` would."""

    workload_key: str                           # the search task's key in the tuning DB
    op: str                                     # its compute definition ("matmul", "batch_matmul")
    sizes: tuple[tuple[str, int], ...]          # its parameters, e.g. (("K", 1024), ("M", 2048), ("N", 4096))
    ops: int                                    # how many ops of the stage it would serve


@dataclass(frozen=True)
class StagePlan:
    """One SPMD program (or, in a pipeline, one stage's programs) on one (sub)mesh."""

    mesh_shape: tuple[int, int]
    axis_names: tuple[str, str]
    device_ids: tuple[int, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    intermediates: tuple[TensorPlan, ...] = ()
    predicted_time_s: float = 0.0               # single stage: the step; pipeline: one micro-batch
    compute_s: float = 0.0
    comm_s: float = 0.0
    reshard_s: float = 0.0
    comm_bytes: float = 0.0
    memory_bytes: float = 0.0                   # predicted peak per device
    argument_bytes: float = 0.0
    collectives: dict[str, float] = field(default_factory=dict)   # kind -> predicted bytes
    solver_status: str = ""
    solve_time_s: float = 0.0
    # pipeline stages
    layer_range: tuple[int, int] | None = None
    submesh: tuple[int, int] | None = None
    forward_s: float = 0.0
    backward_s: float = 0.0
    iteration_s: float = 0.0                    # once per step: the optimizer update
    send_s: float = 0.0
    weight_bytes: float = 0.0                   # params, gradient accumulators, optimizer state
    activation_bytes: float = 0.0               # per micro-batch in flight
    working_bytes: float = 0.0
    in_flight: int = 1
    param_mode: str = ""                        # pipeline stages: "fast" (ILP free) or "sharded" (params most sharded)
    remat: StageRemat | None = None
    layers: tuple[LayerLayout, ...] = ()
    kernels: tuple[KernelUse, ...] = ()         # tuned kernels considered for this stage's ops
    kernel_tasks: tuple[KernelTask, ...] = ()   # the local ops a tuned kernel could serve, as search tasks


@dataclass(frozen=True)
class TimelineTask:
    """A forward ("F") or backward ("B") pass of one micro-batch (token slice `slice` of it,
    with token slicing) on one stage, as simulated."""

    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float
    slice: int = 0


@dataclass(frozen=True)
class PipelineSearch:
    """How much searching the pipeline planner did."""

    micro_batch_candidates: tuple[int, ...]     # B values considered
    micro_batch_evaluated: tuple[int, ...]      # B values priced with the ILP (the rest pruned)
    layer_counts: tuple[int, ...]               # L values tried
    ilp_solves: int
    dp_runs: int
    meshes_priced: int


@dataclass(frozen=True)
class TokenSlicing:
    """Token-level pipelining (TeraPipe): the batch split into micro-batches of these sizes,
    each sequence cut into these slices (token counts), run through the stages in order."""

    seq_len: int
    micro_batch_sizes: tuple[int, ...]
    slices: tuple[tuple[int, ...], ...]          # per micro-batch
    predicted_step_s: float
    unsliced_step_s: float | None                # the same stages with whole sequences (same cost model);
                                                 # None: whole sequences do not fit their memory
    bounds_tried: int = 0
    slice_times: str = "model"                   # "model" (token_cost) or "measured" (profile=True)

    @property
    def num_items(self) -> int:
        return sum(len(s) for s in self.slices)


@dataclass(frozen=True)
class PipelinePlan:
    """The inter-op part of a pipeline plan: layers, micro-batches, schedule, timeline."""

    schedule: str
    num_micro_batches: int
    micro_batch_size: int | None
    layer_cuts: tuple[int, ...]                 # op indices of the micro-batch loss graph
    predicted_step_s: float
    timeline: tuple[TimelineTask, ...] = ()
    search: PipelineSearch | None = None
    token_slices: TokenSlicing | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_cuts) - 1


@dataclass(frozen=True)
class SpmdPipelinePlan:
    """The SPMD pipeline (`pipeline/spmd.py`): the layer scan's L layers split into S
    stages along mesh axis x, each micro-batch split D ways along y, all in one program.
    Times are predicted per device by the roofline of the traced layer (forward, and
    forward + backward for the recomputing backward pass) and the cluster's links."""

    num_stages: int
    data_parallel: int
    num_micro_batches: int
    micro_batch_size: int
    num_layers: int
    stacked_inputs: tuple[int, ...]             # flat step inputs split over stages (leading dim L)
    batch_inputs: tuple[int, ...]               # flat step inputs split over y (the batch)
    layer_forward_s: float                      # one layer, forward, the rows one device holds of a micro-batch
    layer_train_s: float                        # the same layer's forward + backward
    send_s: float                               # one tick's carry to the next stage
    tick_s: float                               # per tick: forward, plus recomputing backward
    rest_s: float                               # the loss outside the scan, and the optimizer update
    grad_sync_s: float                          # gradients all-reduced over y
    predicted_step_s: float
    predicted_argument_bytes: float             # per device: the step's inputs as laid out
    predicted_activation_bytes: float           # per device: carries kept per tick, one tick's residuals
    predicted_gradient_bytes: float             # per device: stacked gradients / S, the others whole
    send_bytes: float                           # per tick and direction, per device
    per_stage_step_s: float | None = None       # the per-stage runtime's prediction, when compared


@dataclass(frozen=True)
class Plan:
    method: str
    signature: str
    cluster: dict[str, Any]
    stages: tuple[StagePlan, ...]
    memory_budget_bytes: float | None = None
    num_micro_batches: int = 1
    schedule: str | None = None
    pipeline: PipelinePlan | None = None
    remat: RematInfo | None = None
    planning_time_s: float = 0.0
    spmd_pipeline: SpmdPipelinePlan | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def predicted_time_s(self) -> float:
        if self.spmd_pipeline is not None:
            return float(self.spmd_pipeline.predicted_step_s)
        if self.pipeline is not None:
            return float(self.pipeline.predicted_step_s)
        return float(sum(s.predicted_time_s for s in self.stages))

    @property
    def num_devices(self) -> int:
        return sum(len(s.device_ids) for s in self.stages)

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
        version = d["schema_version"]
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise PlanFileError(f"plan schema_version {version!r} is not supported by this autopar, which reads "
                                f"schema_version {SCHEMA_VERSION} (an integer); re-plan with this version")
        try:
            plan = _build(Plan, d, "plan")
        except (TypeError, KeyError, ValueError) as e:
            raise PlanFileError(f"corrupt autopar plan: {e}") from None
        ids = [i for s in plan.stages for i in s.device_ids]
        if len(set(ids)) != len(ids):
            raise PlanFileError(f"corrupt autopar plan: device ids {sorted(ids)} repeat a device (each device runs "
                                "one stage once); re-plan")
        return plan

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a failed write never leaves a half-written file over a good one."""
        path = Path(path)
        text = self.to_json()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~_umask())      # mkstemp makes 0600; plans are not secrets
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _build(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) as an instance of type `tp`, checked field by field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs = {k: _build(hints[k], v, f"{where}.{k}") for k, v in value.items()}
        return tp(**kwargs)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _build(a, value, where)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: unexpected null")
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ValueError(f"{where}: expected {len(args)} entries, got {len(value)}")
        return tuple(_build(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return {str(k): _build(args[1], v, f"{where}.{k}") if args else v for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    raise TypeError(f"{where}: cannot read type {tp!r}")
