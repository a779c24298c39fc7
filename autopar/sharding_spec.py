"""How one tensor is laid out on a 2-D logical mesh, and its conversion to PartitionSpec.

A `DimSharding` has one entry per tensor dimension: the tuple of mesh axes (0 and/or 1)
that dimension is split over, major axis first; `()` means not split. A mesh axis appears
at most once per tensor. The mesh axes are named `AXIS_NAMES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from jax.sharding import PartitionSpec

AXIS_NAMES = ("x", "y")

AxisSet = tuple[int, ...]
DimSharding = tuple[AxisSet, ...]


def replicated(ndim: int) -> DimSharding:
    return tuple(() for _ in range(ndim))


def used_axes(spec: DimSharding) -> set[int]:
    return {a for axes in spec for a in axes}


def shard_factor(spec: DimSharding, mesh_shape: tuple[int, int]) -> int:
    """How many pieces the tensor is cut into (its size divided by the per-device size)."""
    n = 1
    for axes in spec:
        for a in axes:
            n *= mesh_shape[a]
    return n


def local_shape(shape: tuple[int, ...], spec: DimSharding, mesh_shape: tuple[int, int]) -> tuple[int, ...]:
    out = []
    for d, axes in zip(shape, spec):
        k = 1
        for a in axes:
            k *= mesh_shape[a]
        out.append(d // k)
    return tuple(out)


def is_valid(shape: tuple[int, ...], spec: DimSharding, mesh_shape: tuple[int, int]) -> bool:
    """Each split dim divides evenly, and no mesh axis (of size > 1) is used twice."""
    if len(spec) != len(shape):
        return False
    seen: list[int] = []
    for d, axes in zip(shape, spec):
        k = 1
        for a in axes:
            k *= mesh_shape[a]
            seen.append(a)
        if d % k:
            return False
    return len(seen) == len(set(seen))


def to_partition_spec(spec: DimSharding) -> PartitionSpec:
    parts = []
    for axes in spec:
        if not axes:
            parts.append(None)
        elif len(axes) == 1:
            parts.append(AXIS_NAMES[axes[0]])
        else:
            parts.append(tuple(AXIS_NAMES[a] for a in axes))
    return PartitionSpec(*parts)


def spec_str(spec: DimSharding) -> str:
    """Alpa-style name: R for a replicated dim, S0 / S1 / S01 for split dims."""
    return "".join("R" if not axes else "S" + "".join(str(a) for a in axes) for axes in spec) or "scalar"


@dataclass(frozen=True)
class Collective:
    """One predicted collective: kind in {all-reduce, all-gather, reduce-scatter, all-to-all},
    per-device buffer bytes as defined by the LogicalMesh cost functions, and mesh axes."""

    kind: str
    nbytes: float
    axes: AxisSet


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on the mesh: operand and result layouts plus costs.

    `in_specs[i]` is the layout the op needs for input i (None: input is a literal, ignore).
    Communication the op itself does (e.g. the all-reduce of partial sums of a matmul whose
    contracting dim is split) is in `collectives` and `comm_s`; `compute_s` is the
    per-device compute time (roofline of the local shard).
    """

    name: str
    in_specs: tuple[DimSharding | None, ...]
    out_specs: tuple[DimSharding, ...]
    compute_s: float
    comm_s: float = 0.0
    collectives: tuple[Collective, ...] = field(default_factory=tuple)
    flops_s: float = 0.0                                 # the FLOP part of compute_s
    io_bytes: tuple[float, ...] = ()                     # local bytes of each input, then each output

    def fused(self, counted: tuple[bool, ...], memory_s) -> "Strategy":
        """The strategy when only the operands and results in `counted` touch memory
        (the others are fused into a neighbouring kernel): compute_s re-derived."""
        if not self.io_bytes:
            return self
        nbytes = sum(b for b, c in zip(self.io_bytes, counted) if c)
        return replace(self, compute_s=max(self.flops_s, float(memory_s(nbytes))))

    @property
    def comm_bytes(self) -> float:
        return float(sum(c.nbytes for c in self.collectives))


def is_transposed(spec: DimSharding) -> bool:
    """Whether the mesh axes occur out of order reading the dims left to right."""
    order = [a for axes in spec for a in axes]
    return order != sorted(order)


def all_layouts(shape: tuple[int, ...], mesh_shape: tuple[int, int]) -> list[DimSharding]:
    """Every valid layout of a tensor on the mesh, skipping splits over size-1 axes and
    transposed tilings (a later dim on mesh axis 0 while an earlier dim is on axis 1).

    XLA lays a transposed tiling out with a permuted device list and splits every collective
    over both axes into one per axis (an all-reduce over each, where the plan priced one
    reduce-scatter), so the cost model's single-collective price would not hold; the layout
    with the axes in mesh order has the same local shapes and is kept. The fully
    replicated layout comes first.
    """
    axes_live = [a for a in (0, 1) if mesh_shape[a] > 1]
    options: list[AxisSet] = [()] + [(a,) for a in axes_live]
    if len(axes_live) == 2:
        options += [(0, 1)]
    out: list[DimSharding] = []

    def rec(i: int, used: frozenset, acc: list) -> None:
        if i == len(shape):
            if not is_transposed(tuple(acc)):
                out.append(tuple(acc))
            return
        for axes in options:
            if used & set(axes):
                continue
            k = 1
            for a in axes:
                k *= mesh_shape[a]
            if shape[i] % k:
                continue
            rec(i + 1, used | set(axes), acc + [axes])

    rec(0, frozenset(), [])
    return out
