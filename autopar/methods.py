"""Parallelization methods: the automatic planner and the textbook baselines.

A single-program method says which logical mesh shapes to try and how graph inputs may
be laid out; the intra-op ILP then chooses everything else. Baselines therefore get the
same (optimal) treatment of intermediates, so comparisons isolate the storage decision.
Every method implements the `autopar.interface.Method` protocol (plan, restore, build);
`PipeshardParallel` (autopar.pipeline) is the pipeline one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar import single_stage
from autopar.interface import PlanRequest
from autopar.plan import Plan
from autopar.sharding_spec import DimSharding, all_layouts, is_valid, replicated


class MeshDivisibilityError(ValueError):
    pass


class SingleProgram:
    """The Method protocol for methods that plan one SPMD program (see `single_stage`)."""

    searches_mirrors = False   # may skip a mesh that mirrors one already solved

    def plan(self, request: PlanRequest) -> single_stage.SingleStagePlanned:
        return single_stage.plan(self, request)

    def restore(self, plan: Plan, request: PlanRequest) -> single_stage.SingleStagePlanned:
        return single_stage.restore(plan, request)

    def build(self, planned: single_stage.SingleStagePlanned, request: PlanRequest) -> Any:
        return single_stage.build(planned, request)


@dataclass(frozen=True)
class ShardParallel(SingleProgram):
    """Alpa's intra-op planner over every 2-D logical mesh (or the one given)."""

    mesh_shape: tuple[int, int] | None = None
    solver: str = "highs"
    time_limit_s: float = 30.0

    name = "auto"

    @property
    def searches_mirrors(self) -> bool:
        return self.mesh_shape is None

    def mesh_shapes(self, n: int) -> list[tuple[int, int]]:
        if self.mesh_shape is not None:
            if self.mesh_shape[0] * self.mesh_shape[1] != n:
                raise MeshDivisibilityError(f"mesh_shape {self.mesh_shape} does not use the {n} devices given")
            return [tuple(self.mesh_shape)]
        return [(a, n // a) for a in range(1, n + 1) if n % a == 0]

    def input_layouts(self, shape, is_batch: bool, mesh_shape, name: str) -> tuple[DimSharding | None, list[DimSharding] | None]:
        return None, None


def _batch_spec(shape, axes: tuple[int, ...], mesh_shape, name: str) -> DimSharding:
    if not shape:
        return ()
    spec = (axes,) + replicated(len(shape) - 1)
    if not is_valid(tuple(shape), spec, tuple(mesh_shape)):
        n = 1
        for a in axes:
            n *= mesh_shape[a]
        raise MeshDivisibilityError(
            f"batch argument {name} has leading dimension {shape[0]}, which the {n} data-parallel devices "
            f"(mesh {mesh_shape[0]}x{mesh_shape[1]}) do not divide; use a batch size that is a multiple of {n}, "
            f"fewer devices, or method='auto'")
    return spec


@dataclass(frozen=True)
class DataParallel(SingleProgram):
    """Replicated parameters and optimizer state; the batch split over every device."""

    name = "data_parallel"
    solver: str = "highs"
    time_limit_s: float = 30.0

    def mesh_shapes(self, n: int) -> list[tuple[int, int]]:
        return [(1, n)]

    def input_layouts(self, shape, is_batch, mesh_shape, name):
        if is_batch:
            return _batch_spec(shape, (1,), mesh_shape, name), None
        return replicated(len(shape)), None


@dataclass(frozen=True)
class ZeRO3(DataParallel):
    """Fully sharded parameters and optimizer state (largest divisible dim over all devices)."""

    name = "zero3"

    def input_layouts(self, shape, is_batch, mesh_shape, name):
        if is_batch:
            return super().input_layouts(shape, is_batch, mesh_shape, name)
        n = mesh_shape[1]
        dims = sorted(range(len(shape)), key=lambda d: -shape[d])
        for d in dims:
            if shape[d] % n == 0 and n > 1:
                return tuple((1,) if i == d else () for i in range(len(shape))), None
        return replicated(len(shape)), None


@dataclass(frozen=True)
class Megatron(SingleProgram):
    """Tensor parallel over `tp` devices (mesh axis 1), data parallel over the rest (axis 0).

    Parameters may be split over the tensor-parallel axis only (the ILP picks column- or
    row-parallel per weight, which includes Megatron's pairing); the batch over axis 0.
    """

    tp: int = 2
    solver: str = "highs"
    time_limit_s: float = 30.0

    @property
    def name(self) -> str:
        return f"megatron(tp={self.tp})"

    def mesh_shapes(self, n: int) -> list[tuple[int, int]]:
        if self.tp < 1 or n % self.tp:
            raise MeshDivisibilityError(f"Megatron(tp={self.tp}) needs a device count divisible by tp; got {n} devices")
        return [(n // self.tp, self.tp)]

    def input_layouts(self, shape, is_batch, mesh_shape, name):
        if is_batch:
            return (_batch_spec(shape, (0,), mesh_shape, name) if mesh_shape[0] > 1 else replicated(len(shape))), None
        allowed = [l for l in all_layouts(tuple(shape), tuple(mesh_shape)) if all(a == 1 for axes in l for a in axes)]
        return None, allowed


def resolve_method(method) -> Any:
    """A method object from the user's `method=` ("auto" is ShardParallel())."""
    if method == "auto" or method is None:
        return ShardParallel()
    if isinstance(method, str):
        raise ValueError(f"unknown method {method!r}; use 'auto' or an object such as autopar.DataParallel(), "
                         "autopar.ZeRO3(), autopar.Megatron(tp=2), autopar.ShardParallel(), autopar.PipeshardParallel(...)")
    missing = [m for m in ("plan", "restore", "build") if not callable(getattr(method, m, None))]
    if missing:
        raise TypeError(f"method={method!r} is not a parallelization method (it has no {', '.join(missing)}); "
                        "use 'auto' or one of autopar.ShardParallel, DataParallel, ZeRO3, Megatron, PipeshardParallel")
    return method


def method_for_plan(plan: Plan, method: Any) -> Any:
    """The method that builds a saved plan: the given one, or for method="auto" the kind
    the plan was made with (a pipeline plan needs the pipeline method)."""
    if (plan.pipeline is None and plan.spmd_pipeline is None) or not isinstance(method, ShardParallel):
        return method
    from autopar.pipeline.method import PipeshardParallel

    if plan.spmd_pipeline is not None:
        return PipeshardParallel(num_micro_batches=plan.num_micro_batches, lowering="spmd")

    return PipeshardParallel(num_micro_batches=plan.num_micro_batches, schedule=plan.schedule or "1f1b")
