"""`PipeshardParallel`: the user's choice of pipeline parallelism, and its plan / restore /
build (the `autopar.interface.Method` protocol)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from autopar.pipeline.schedule import SCHEDULES

if TYPE_CHECKING:
    from autopar.pipeline.stage import PlacedStage

LOWERINGS = ("auto", "spmd", "per-stage")


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes, each with its own intra-op sharding.

    num_micro_batches: micro-batches per step (the batch's leading dim must divide by it),
        or "auto": the planner chooses among the divisors of the batch size.
    schedule: "1f1b" (at most S micro-batches of activations alive) or "gpipe".
    num_stages: None lets the stage DP choose.
    layers: "auto" (layer clustering searches L; `mark_stage_boundary` markers, when
        present, define the layers) or an int L.
    submeshes: "auto" or a list of (hosts, devices) shapes, one per stage.
    devices_per_host: the width of a host when planning (default: all given devices
        form one host).
    imbalance_tolerance: Alpa's pruning of the stage DP's slowest-stage bound: a new bound
        is tried only when it exceeds the last one by this fraction (0 = exact).
    solver: the ILP solver of the layers ("highs-lp": the LP relaxation first, "highs",
        "cbc"); time_limit_s per layer ILP.
    planning_tolerance: stop searching once the best plan found is within this fraction of
        the lower bound on every better one (0 = exact; the plan is within (1 + it) of the
        optimum under the cost model).
    token_slices: token-level pipelining (TeraPipe) for causal LMs whose attention is
        `autopar.causal_attention`: 1 (whole sequences), an int (that many equal slices per
        sequence), a list of slice lengths, or "auto" (TeraPipe's DP chooses the slices and
        the split of the batch into micro-batches).
    lowering: "per-stage" (one program per stage and micro-batch, driven from Python),
        "spmd" (the loss's layer scan, e.g. flax nn.scan, pipelined inside one program:
        `pipeline/spmd.py`) or "auto": the SPMD pipeline when the loss has a layer scan and
        it is predicted faster than the per-stage plan.
    profile: with token_slices, price the slices from the stages' forward and backward
        timed on their own devices (`pipeline/token_profile.py`) instead of the cost model:
        TeraPipe's measured slice times, which see what a model cannot (a thin slice below
        peak, a fixed cost per program). Needs the devices the plan runs on, in one process.
    """

    num_micro_batches: int | str = 1
    schedule: str = "1f1b"
    num_stages: int | None = None
    layers: str | int = "auto"
    submeshes: str | Sequence[tuple[int, int]] = "auto"
    devices_per_host: int | None = None
    imbalance_tolerance: float = 0.0
    solver: str = "highs-lp"
    time_limit_s: float = 30.0
    planning_tolerance: float = 0.02
    token_slices: int | str | Sequence[int] = 1
    lowering: str = "auto"
    profile: bool = False
    # the layer ILP solutions of every plan this method makes (keyed by content and mesh):
    # planning again under another budget, cluster or batch reuses them
    _layer_solver: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        B = self.num_micro_batches
        if B != "auto" and (isinstance(B, bool) or not isinstance(B, int) or B < 1):
            raise ValueError(f"num_micro_batches must be a positive int or 'auto', got {B!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.num_stages is not None and (not isinstance(self.num_stages, int) or self.num_stages < 1):
            raise ValueError(f"num_stages must be None or a positive int, got {self.num_stages!r}")
        if self.layers != "auto" and (not isinstance(self.layers, int) or self.layers < 1):
            raise ValueError(f"layers must be 'auto' or a positive int, got {self.layers!r}")
        if self.submeshes != "auto":
            shapes = [tuple(s) for s in self.submeshes]
            if any(len(s) != 2 or min(s) < 1 for s in shapes):
                raise ValueError(f"submeshes must be 'auto' or a list of (hosts, devices) pairs, "
                                 f"got {self.submeshes!r}")
            if self.num_stages is not None and len(shapes) != self.num_stages:
                raise ValueError(f"{len(shapes)} submeshes given for num_stages={self.num_stages}")
            object.__setattr__(self, "submeshes", tuple(shapes))
        if self.imbalance_tolerance < 0:
            raise ValueError("imbalance_tolerance must be >= 0")
        t = self.token_slices
        if isinstance(t, (list, tuple)):
            if not t or any(isinstance(l, bool) or not isinstance(l, int) or l < 1 for l in t):
                raise ValueError(f"token_slices as a list must hold positive token counts, got {t!r}")
            object.__setattr__(self, "token_slices", tuple(t))
        elif t != "auto" and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"token_slices must be 1, a positive int, a list of slice lengths or 'auto', got {t!r}")
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.lowering == "spmd" and (self.token_slices != 1 or self.submeshes != "auto"):
            raise ValueError("lowering='spmd' runs equal stages of the layer scan on one mesh: it takes neither "
                             "token_slices nor submeshes; use lowering='per-stage' for those")
        if self.profile and self.token_slices == 1:
            raise ValueError("profile=True measures token slice times: it needs token_slices != 1 "
                             "(an int, a list of lengths or 'auto')")
        if not 0 <= self.planning_tolerance < 1:
            raise ValueError(f"planning_tolerance must be in [0, 1), got {self.planning_tolerance!r}")

    @property
    def name(self) -> str:
        slices = "" if self.token_slices == 1 else f", token_slices={self.token_slices}" + \
            (", profiled" if self.profile else "")
        lowering = "" if self.lowering == "auto" else f", lowering={self.lowering}"
        return f"pipeshard({self.schedule}, B={self.num_micro_batches}{slices}{lowering})"

    # --- the Method protocol -------------------------------------------------------------
    def _cluster(self, request: Any) -> Any:
        from autopar.cluster import Cluster

        c = request.cluster
        if self.devices_per_host is None or self.devices_per_host == c.devices_per_host:
            return c
        n = c.num_devices
        if n % self.devices_per_host:
            raise ValueError(f"{n} devices do not form whole hosts of devices_per_host={self.devices_per_host}")
        return Cluster(c.device, n // self.devices_per_host, self.devices_per_host, c.intra_host, c.inter_host)

    def _planner(self, request: Any) -> Any:
        from autopar.pipeline.layer_cost import LayerSolver
        from autopar.pipeline.planner import PipelinePlanner
        from autopar.pipeline.trace import StepTracer

        if request.kwargs:
            raise TypeError("PipeshardParallel steps take positional arguments only")
        cluster = self._cluster(request)
        limit = request.memory_budget_bytes if request.memory_budget_bytes is not None else cluster.device.memory_bytes
        if self._layer_solver is None:
            object.__setattr__(self, "_layer_solver", LayerSolver(time_limit_s=self.time_limit_s, solver=self.solver))
        return PipelinePlanner(StepTracer(request.fun, request.args, request.batch_argnums), self, cluster, limit,
                               time_limit_s=self.time_limit_s, remat=request.remat, solver=self._layer_solver)

    def plan(self, request: Any) -> Any:
        """Trace, run the joint planner and record the decision as a Plan."""
        from autopar.pipeline.record import to_plan

        t0 = time.perf_counter()
        if request.kernels != "xla" and (self.lowering == "spmd" or self.token_slices != 1):
            raise ValueError(f"kernels={request.kernels!r} works with the per-stage pipeline runtime; "
                             f"{'the SPMD lowering' if self.lowering == 'spmd' else 'token slicing'} runs XLA's code "
                             f"only: use lowering='per-stage' and token_slices=1, or kernels='xla'")
        planner = self._planner(request)
        # tuned kernels serve the per-stage runtime's layer graphs: the SPMD lowering is not considered
        spmd = self._plan_spmd(request, planner) if request.kernels == "xla" else None
        if self.lowering == "spmd":
            return spmd_planned(spmd, planner, request, self.name, t0)
        try:
            decision = planner.plan()
        except ValueError:
            if spmd is None:
                raise
            return spmd_planned(spmd, planner, request, self.name, t0)
        if spmd is not None and spmd.predicted_step_s < decision.latency_s:
            return spmd_planned(replace(spmd, per_stage_step_s=decision.latency_s), planner, request,
                                self.name, t0)
        _check_loss_is_batch_mean(planner, decision.traced)
        token = None
        if self.token_slices != 1:
            from autopar.pipeline.token_plan import plan_token_slices, sliced_decision

            token = plan_token_slices(planner, decision, self.token_slices, self._profile_devices(request))
            decision = sliced_decision(decision, token.slicing)
        ids = request.device_ids or tuple(range(request.cluster.num_devices))
        plan = to_plan(decision, method_name=self.name, schedule=self.schedule, signature=request.signature,
                       cluster=planner.cluster, memory_budget_bytes=request.memory_budget_bytes, device_ids=ids,
                       planning_s=time.perf_counter() - t0, token=token)
        from autopar.pipeline.stage_kernels import with_stage_kernels

        planned = PipelinePlanned(plan, decision.traced, tuple(d.placed() for d in decision.stages), planner)
        return with_stage_kernels(planned, request) if token is None else planned

    def _profile_devices(self, request: Any) -> Any:
        """The devices to measure slice times on (profile=True), or None."""
        if not self.profile:
            return None
        import jax

        if request.devices is None:
            raise ValueError("profile=True times the token slices on the devices the plan runs on, but this plan "
                             "is for a cluster that is not here; plan with profile=False (the cost model) or on "
                             "the devices themselves")
        if jax.process_count() > 1:
            raise ValueError("profile=True measures in one process; with several processes each would time "
                             "alone and could choose different slicings: use profile=False")
        return list(request.devices)

    def _plan_spmd(self, request: Any, planner: Any) -> Any:
        """The best SPMD pipeline (a SpmdPipelinePlan), or None where it does not apply
        under lowering="auto" (no layer scan, token slices, given submeshes)."""
        from autopar.pipeline.spmd import SpmdPipelineError
        from autopar.pipeline.spmd_plan import SpmdPlanner

        if self.lowering == "per-stage" or self.token_slices != 1 or self.submeshes != "auto":
            return None
        try:
            sp = SpmdPlanner(planner.tracer, planner.cluster, request.num_devices)
            return sp.plan(self.num_stages, self.num_micro_batches, planner.memory_limit_bytes)
        except SpmdPipelineError:
            if self.lowering == "spmd":
                raise
            return None

    def restore(self, plan: Any, request: Any) -> Any:
        """A saved pipeline plan on the re-traced step, without planning again."""
        from autopar.pipeline.record import restore
        from autopar.plan import PlanFileError

        if plan.spmd_pipeline is not None:
            return SpmdPlanned(plan, self._planner(request).tracer)
        if plan.pipeline is None:
            raise PlanFileError("this is a single-stage plan; reuse it with a single-program method (method='auto')")
        planner = self._planner(request)
        devices = request.devices or ()
        traced, stages = restore(plan, planner, {d.id: d for d in devices})
        _check_loss_is_batch_mean(planner, traced)
        from autopar.pipeline.stage_kernels import with_stage_kernels

        from autopar.pipeline.stage import PlacedStage

        index = {d.id: k for k, d in enumerate(devices)}
        planned = PipelinePlanned(plan, traced, tuple(
            PlacedStage(layers=s.layers, layouts=tuple(s.layouts), device_indices=tuple(index[d.id] for d in s.devices),
                        logical_mesh=s.mesh_shape) for s in stages), planner)
        return with_stage_kernels(planned, request) if plan.pipeline.token_slices is None else planned

    def build(self, planned: Any, request: Any) -> Any:
        from autopar.pipeline.executable import PipeshardExecutable
        from autopar.pipeline.stage import stage_programs

        if isinstance(planned, SpmdPlanned):
            from autopar.pipeline.spmd_executable import SpmdPipelineExecutable

            return SpmdPipelineExecutable(planned.plan, planned.tracer, request.devices, request.donate_argnums)
        devices = list(request.devices)
        programs = stage_programs(planned.stages, devices, planned.traced.num_micro_batches, planned.kernels)
        return PipeshardExecutable(planned.plan, planned.traced, programs, devices, tracer=planned.planner.tracer)


def _check_loss_is_batch_mean(planner: Any, traced: Any) -> None:
    """Warn when micro-batching changes the loss (`loss_check`): the loss at the full
    batch, with the inputs this plan splits into micro-batches."""
    from autopar.pipeline.loss_check import warn_if_not_batch_mean

    warn_if_not_batch_mean(planner.tracer.at(1).loss, traced.split_mask, traced.num_micro_batches)


@dataclass(frozen=True)
class PipelinePlanned:
    """A pipeline decision: the Plan, the traced step, and its stages as they are built."""

    plan: Any
    traced: Any
    stages: tuple[PlacedStage, ...]
    planner: Any
    kernels: tuple = ()         # per stage, per layer: kernel_choice.ChosenKernels (kernels != "xla")


@dataclass(frozen=True)
class SpmdPlanned:
    """An SPMD pipeline decision: the Plan and the traced step it is built from."""

    plan: Any
    tracer: Any


def spmd_planned(sp: Any, planner: Any, request: Any, name: str, t0: float) -> SpmdPlanned:
    from autopar.pipeline.spmd_plan import spmd_plan

    ids = request.device_ids or tuple(range(request.cluster.num_devices))
    plan = spmd_plan(sp, planner.tracer, name=name, signature=request.signature, cluster=planner.cluster,
                     memory_budget_bytes=request.memory_budget_bytes, device_ids=ids,
                     planning_s=time.perf_counter() - t0)
    return SpmdPlanned(plan, planner.tracer)
