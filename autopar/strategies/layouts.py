"""Candidate tensor layouts on a 2-D mesh and the cost bookkeeping shared by all rules.

A rule turns an op into `Strategy` objects; this module holds what every rule needs:
the valid layouts of a shape, per-device bytes of a layout, the roofline compute time of
the local shard and the time of the collectives a strategy predicts.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Iterable, Sequence

from rockmate.graph.op_graph import TensorSpec
from autopar.sharding_spec import Collective, DimSharding, Strategy, is_valid, spec_str

MeshShape = tuple[int, int]


def mesh_shape_of(mesh: Any) -> MeshShape:
    return tuple(int(s) for s in mesh.shape)  # type: ignore[return-value]


def live_axes(mesh_shape: MeshShape) -> tuple[int, ...]:
    """Mesh axes worth splitting over (size > 1)."""
    return tuple(a for a, s in enumerate(mesh_shape) if s > 1)


@functools.lru_cache(maxsize=4096)
def candidate_specs(shape: tuple[int, ...], mesh_shape: MeshShape,
                    splittable: tuple[bool, ...] | None = None) -> tuple[DimSharding, ...]:
    """Every valid layout of `shape`: each live mesh axis unused or on one (splittable) dim;
    two axes on one dim only in the order (0, 1). Replicated first."""
    ndim = len(shape)
    dims = [d for d in range(ndim) if splittable is None or splittable[d]]
    axes = live_axes(mesh_shape)
    out: list[DimSharding] = []
    for choice in itertools.product([None, *dims], repeat=len(axes)):
        spec: list[tuple[int, ...]] = [() for _ in range(ndim)]
        for a, d in zip(axes, choice):
            if d is not None:
                spec[d] = spec[d] + (a,)
        s = tuple(spec)
        if is_valid(shape, s, mesh_shape):
            out.append(s)
    return tuple(out)


def local_bytes(t: TensorSpec, spec: DimSharding | None, mesh_shape: MeshShape) -> float:
    """Per-device bytes of tensor `t` laid out as `spec` (None: replicated)."""
    n = t.nbytes
    if spec:
        for axes in spec:
            for a in axes:
                n //= mesh_shape[a]
    return float(n)


def axes_product(axes: Iterable[int], mesh_shape: MeshShape) -> int:
    k = 1
    for a in axes:
        k *= mesh_shape[a]
    return k


def collective_s(mesh: Any, c: Collective) -> float:
    """Time of one predicted collective under the mesh's alpha-beta model."""
    fn = {
        "all-reduce": mesh.all_reduce_s,
        "all-gather": mesh.all_gather_s,
        "reduce-scatter": mesh.reduce_scatter_s,
        "all-to-all": mesh.all_to_all_s,
    }[c.kind]
    return float(fn(c.nbytes, tuple(c.axes)))


def make_strategy(
    mesh: Any,
    ins: Sequence[TensorSpec | None],
    outs: Sequence[TensorSpec],
    in_specs: Sequence[DimSharding | None],
    out_specs: Sequence[DimSharding],
    flops: float,
    collectives: Sequence[Collective] = (),
    name: str | None = None,
    split_flops: bool = True,
    dtype: str | None = None,
) -> Strategy:
    """Build a Strategy: compute_s is the roofline of the local shard (flops divided by every
    mesh axis some operand or result is split over), comm_s the sum of its collectives."""
    ms = mesh_shape_of(mesh)
    used: set[int] = set()
    io: list[float] = []
    for t, s in zip(ins, in_specs):
        if t is None:
            io.append(0.0)
            continue
        io.append(local_bytes(t, s, ms))
        if s:
            used.update(a for axes in s for a in axes)
    for t, s in zip(outs, out_specs):
        io.append(local_bytes(t, s, ms))
        used.update(a for axes in s for a in axes)
    nbytes = sum(io)
    local_flops = flops / axes_product(used, ms) if split_flops else flops
    if dtype is None:
        dtype = outs[0].dtype if outs else "float32"
    try:
        compute = mesh.compute_s(local_flops, dtype)
    except Exception:  # noqa: BLE001 - extended dtypes: count as float32 work
        compute = mesh.compute_s(local_flops, "float32")
    compute_s = max(float(compute), float(mesh.memory_s(nbytes)))
    colls = tuple(c for c in collectives if axes_product(c.axes, ms) > 1)
    comm_s = sum(collective_s(mesh, c) for c in colls)
    if name is None:
        ins_txt = ",".join(spec_str(s) for s in in_specs if s is not None)
        name = f"{ins_txt}->{','.join(spec_str(s) for s in out_specs)}"
        if colls:
            name += " [" + " ".join(f"{_short(c.kind)}{''.join(map(str, c.axes))}" for c in colls) + "]"
    return Strategy(name=name, in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                    compute_s=compute_s, comm_s=comm_s, collectives=colls, flops_s=float(compute), io_bytes=tuple(io))


def _short(kind: str) -> str:
    return {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A"}[kind]


def replicated_strategy(mesh: Any, ins: Sequence[TensorSpec | None], outs: Sequence[TensorSpec],
                        flops: float, name: str = "replicated") -> Strategy:
    """Every operand and result whole on every device."""
    return make_strategy(
        mesh, ins, outs,
        [None if t is None else tuple(() for _ in t.shape) for t in ins],
        [tuple(() for _ in t.shape) for t in outs],
        flops, name=name,
    )


def dedupe(strategies: Iterable[Strategy]) -> list[Strategy]:
    """Drop strategies with the same layouts as an earlier, no cheaper one."""
    best: dict[tuple, Strategy] = {}
    order: list[tuple] = []
    for s in strategies:
        key = (s.in_specs, s.out_specs)
        if key not in best:
            order.append(key)
            best[key] = s
        elif s.compute_s + s.comm_s < best[key].compute_s + best[key].comm_s:
            best[key] = s
    return [best[k] for k in order]


def follow_strategies(mesh: Any, ins: Sequence[TensorSpec | None], outs: Sequence[TensorSpec],
                      ref: TensorSpec, splittable: tuple[bool, ...], flops: float,
                      ) -> list[Strategy]:
    """Ops whose operands and results share one layout over the dims in `splittable`
    (sizes agree there): enumerate layouts of `ref`, give every same-rank tensor that
    layout, rank-0 or other-rank tensors replicated, literals None."""
    ms = mesh_shape_of(mesh)
    result = []
    for spec in candidate_specs(ref.shape, ms, splittable):
        in_specs = [None if t is None else _same_rank(t, ref, spec) for t in ins]
        out_specs = [_same_rank(t, ref, spec) for t in outs]
        tensors = [*zip(ins, in_specs), *zip(outs, out_specs)]
        if all(t is None or is_valid(t.shape, s, ms) for t, s in tensors):
            result.append(make_strategy(mesh, ins, outs, in_specs, out_specs, flops))
    return result


def _same_rank(t: TensorSpec, ref: TensorSpec, spec: DimSharding) -> DimSharding:
    if t.ndim != ref.ndim:
        return tuple(() for _ in t.shape)
    return spec
