"""`ShardingCosts`: the intra-op pass's per-op strategies, reshard costs and repeated-layer
structure, memoised for one planning run. Planning asks for the same answers thousands of
times (repeated layers, the same layer on several meshes, stage compositions); the memo
lives as long as the planner that owns it, so nothing grows at module level."""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from autopar.resharding import reshard_cost
from autopar.sharding_spec import Collective, DimSharding, Strategy
from autopar.strategies import enumerate_strategies
from rockmate.graph.op_graph import Op, OpGraph, TensorSpec

T = TypeVar("T")


class ShardingCosts:
    """Memoised `enumerate_strategies` and `reshard_cost`, plus one per-graph slot for
    structure derived from the graph being planned (e.g. its repeated layers)."""

    def __init__(self) -> None:
        self._strategies: dict[tuple, list[Strategy]] = {}
        self._fused: dict[tuple, list[Strategy]] = {}
        self._matrices: dict[tuple, np.ndarray] = {}
        self._reshards: dict[tuple, tuple[float, tuple[Collective, ...]]] = {}
        self._paths: dict[Any, dict] = {}       # per mesh: source layout -> shortest-path table
        self._meshes: dict[int, Any] = {}        # unhashable meshes, kept alive so their ids stay unique
        self._graph: tuple[OpGraph, dict[str, Any]] | None = None

    def strategies(self, op: Op, graph: OpGraph, mesh: Any, counted: tuple[bool, ...] | None = None
                   ) -> list[Strategy]:
        """`enumerate_strategies(op, graph, mesh)`, computed once per op content and mesh;
        with `counted`, each strategy `fused` to touch memory only for those operands and
        results (also computed once)."""
        ins = tuple(None if v in graph.literals else graph.vars[v] for v in op.inputs)
        outs = tuple(graph.vars[v] for v in op.outputs)
        key = _op_key(op, ins, outs, self._mesh_key(mesh))
        def fused(strats: list[Strategy]) -> list[Strategy]:
            return [s.fused(counted, mesh.memory_s) for s in strats]

        if key is None:
            strats = enumerate_strategies(op, graph, mesh)
            return strats if counted is None else fused(strats)
        if key not in self._strategies:
            self._strategies[key] = enumerate_strategies(op, graph, mesh)
        if counted is None:
            return list(self._strategies[key])
        if (key, counted) not in self._fused:
            self._fused[(key, counted)] = fused(self._strategies[key])
        return list(self._fused[(key, counted)])

    def reshard_matrix(self, src: Sequence[DimSharding], dst: Sequence[DimSharding], tensor: TensorSpec,
                       mesh: Any) -> np.ndarray:
        """Reshard seconds from each layout of `src` (rows) into each of `dst` (columns);
        the same edges recur across repeated layers, options and stages of one run."""
        key = (tuple(src), tuple(dst), tensor.shape, tensor.dtype, self._mesh_key(mesh))
        m = self._matrices.get(key)
        if m is None:
            m = self._matrices[key] = np.array([[self.reshard(a, b, tensor, mesh)[0] for b in dst] for a in src])
            m.setflags(write=False)
        return m

    def reshard(self, src: DimSharding, dst: DimSharding, tensor: TensorSpec, mesh: Any
                ) -> tuple[float, tuple[Collective, ...]]:
        """`reshard_cost(src, dst, tensor, mesh)`, computed once per layouts, tensor and mesh."""
        if src == dst:
            return 0.0, ()
        mesh_key = self._mesh_key(mesh)
        key = (src, dst, tensor.shape, tensor.dtype, mesh_key)
        hit = self._reshards.get(key)
        if hit is None:
            hit = self._reshards[key] = reshard_cost(src, dst, tensor, mesh, self._paths.setdefault(mesh_key, {}))
        return hit

    def of_graph(self, graph: OpGraph, name: str, compute: Callable[[], T]) -> T:
        """`compute()` once per graph (the latest graph asked about is kept)."""
        if self._graph is None or self._graph[0] is not graph:
            self._graph = (graph, {})
        slots = self._graph[1]
        if name not in slots:
            slots[name] = compute()
        return slots[name]

    def _mesh_key(self, mesh: Any) -> Any:
        """A LogicalMesh is keyed by value (equal meshes share results), others by identity."""
        try:
            hash(mesh)
            return mesh
        except TypeError:
            self._meshes[id(mesh)] = mesh
            return ("id", id(mesh))


def _op_key(op: Op, ins: tuple, outs: tuple, mesh_key: Any) -> tuple | None:
    """What an op's strategies depend on, or None when its params cannot be hashed (e.g. a
    scan's body): such ops are enumerated every time."""
    try:
        params = tuple(sorted((k, _freeze(v)) for k, v in op.params.items()))
        hash(params)
    except TypeError:
        return None
    return (op.name, ins, outs, params, float(op.flops), mesh_key)


def _freeze(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if hasattr(v, "jaxpr") or hasattr(v, "eqns"):
        raise TypeError("jaxpr params are not keyed")
    hash(v)
    return v
