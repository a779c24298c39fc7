"""Compute definitions: each stage is an index expression over named axes (with an optional
reduction), stages form a DAG from input placeholders to one output tensor."""
from __future__ import annotations

from dataclasses import dataclass

from .expr import Expr, Load, Var, loads, op_counts


@dataclass(frozen=True)
class Axis:
    name: str
    extent: int


@dataclass(frozen=True)
class Stage:
    """`name[axes] = reduce_op over reduce_axes of body` (or `= body` when reduce_op is None)."""

    name: str
    axes: tuple[Axis, ...]
    body: Expr
    reduce_axes: tuple[Axis, ...] = ()
    reduce_op: str | None = None  # "sum" | "max"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.extent for a in self.axes)

    def reads(self) -> set[str]:
        return {ld.tensor for ld in loads(self.body)}

    def flops(self) -> int:
        """Floating-point operations to compute the whole stage (reduction update included)."""
        n = 1
        for a in self.axes + self.reduce_axes:
            n *= a.extent
        per_point = sum(op_counts(self.body).values()) + (1 if self.reduce_op else 0)
        return n * per_point


@dataclass(frozen=True)
class ComputeDAG:
    """Input placeholders (name -> shape), stages in topological order, the output's name."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    stages: tuple[Stage, ...]
    output: str

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; stages are {[s.name for s in self.stages]}")

    def shape_of(self, tensor: str) -> tuple[int, ...]:
        for n, shp in self.inputs:
            if n == tensor:
                return shp
        return self.stage(tensor).shape

    def consumers(self, name: str) -> list[str]:
        return [s.name for s in self.stages if name in s.reads()]

    def flops(self) -> int:
        return sum(s.flops() for s in self.stages)


def axes(**extents: int) -> tuple[Axis, ...]:
    return tuple(Axis(n, e) for n, e in extents.items())


def load(tensor: str, *index) -> Load:
    return Load(tensor, tuple(Var(i) if isinstance(i, str) else i for i in index))
