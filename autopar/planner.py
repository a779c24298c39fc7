"""Single-program planning: try each logical mesh of a method and keep the cheapest ILP plan."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import jax

from autopar.cluster import Cluster, LogicalMesh
from rockmate.graph.op_graph import OpGraph
from autopar.intra_op import MemoryBudgetError, ShardingPlan, plan_sharding
from autopar.plan import StagePlan, TensorPlan
from autopar.sharding_costs import ShardingCosts
from autopar.sharding_spec import AXIS_NAMES, DimSharding

# Intermediates recorded in the plan (for reading and for reuse); the rest follow by propagation.
RECORDED_PRIMITIVES = {"dot_general", "conv_general_dilated", "scan", "gather", "scatter-add", "scatter_add",
                       "reduce_sum", "reduce_max", "argmax", "cumsum"}


@dataclass(frozen=True)
class InputInfo:
    """What the planner knows about one flat argument."""

    name: str
    is_batch: bool


def input_infos(args: tuple, kwargs: dict, batch_argnums: Sequence[int]) -> list[InputInfo]:
    infos = []
    for i, a in enumerate(args):
        for path, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            infos.append(InputInfo(f"args[{i}]{jax.tree_util.keystr(path)}", i in batch_argnums))
    for path, _ in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
        infos.append(InputInfo(f"kwargs{jax.tree_util.keystr(path)}", False))
    return infos


def state_ties(graph: OpGraph, args: tuple, batch_argnums: Sequence[int]) -> dict[int, int]:
    """Outputs that are a new version of a non-batch argument (same pytree and leaf types)
    are returned in that argument's layout: output position -> input position."""
    out_struct = jax.tree_util.tree_unflatten(graph.out_tree, list(range(len(graph.outvars))))
    candidates = list(out_struct) if isinstance(out_struct, (tuple, list)) else [out_struct]
    ties: dict[int, int] = {}
    offset = 0
    for i, a in enumerate(args):
        leaves, tree = jax.tree_util.tree_flatten(a)
        if i not in batch_argnums and leaves:
            for cand in candidates:
                pos, ctree = jax.tree_util.tree_flatten(cand)
                if ctree == tree and all(isinstance(p, int) for p in pos):
                    ok = all(graph.vars[graph.outvars[p]].shape == graph.vars[graph.invars[offset + k]].shape and
                             graph.vars[graph.outvars[p]].dtype == graph.vars[graph.invars[offset + k]].dtype
                             for k, p in enumerate(pos) if graph.outvars[p] in graph.vars)
                    if ok and not any(p in ties for p in pos):
                        ties.update({p: offset + k for k, p in enumerate(pos)})
                        break
        offset += len(leaves)
    return ties


def plan_single_stage(graph: OpGraph, cluster: Cluster, method: Any, infos: list[InputInfo], *,
                      num_devices: int | None = None, memory_budget_bytes: float = math.inf,
                      tie_outputs: dict[int, int] | None = None, memory_scope: str = "peak",
                      costs: ShardingCosts | None = None) -> tuple[ShardingPlan, LogicalMesh]:
    """Solve the ILP on every mesh shape the method allows; return the cheapest plan.
    `costs`: the planning run's memo of strategies and reshard costs (fresh if None)."""
    costs = costs or ShardingCosts()
    n = num_devices or cluster.num_devices
    best: tuple[ShardingPlan, LogicalMesh] | None = None
    errors: list[MemoryBudgetError] = []
    solved: set = set()
    for shape in method.mesh_shapes(n):
        mesh = cluster.logical_mesh(shape)
        # (b, a) with mirrored link costs is the same problem as (a, b) with the axes swapped
        key = (tuple(shape), mesh.alpha_s, mesh.beta_s_per_byte)
        mirror = ((shape[1], shape[0]), mesh.alpha_s[::-1], mesh.beta_s_per_byte[::-1])
        if mirror in solved and method.searches_mirrors:
            continue
        solved.add(key)
        fixed: dict[int, DimSharding] = {}
        allowed: dict[int, list[DimSharding]] = {}
        for v, info in zip(graph.invars, infos):
            if v in graph.literals:
                continue
            f, al = method.input_layouts(graph.vars[v].shape, info.is_batch, shape, info.name)
            if f is not None:
                fixed[v] = f
            if al is not None:
                allowed[v] = al
        try:
            sp = plan_sharding(graph, mesh, memory_budget_bytes=memory_budget_bytes, fixed_specs=fixed,
                               allowed_specs=allowed, tie_outputs=tie_outputs,
                               time_limit_s=getattr(method, "time_limit_s", 30.0), solver=getattr(method, "solver", "highs"),
                               memory_scope=memory_scope, costs=costs)
        except MemoryBudgetError as e:
            errors.append(e)
            continue
        if best is None or sp.objective_s < best[0].objective_s:
            best = (sp, mesh)
    if best is None:
        e = min(errors, key=lambda e: e.min_bytes)
        raise e
    return best


def _axis_names(spec: DimSharding) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(AXIS_NAMES[a] for a in axes) for axes in spec)


def stage_plan(graph: OpGraph, sp: ShardingPlan, infos: list[InputInfo], device_ids: Sequence[int],
               out_names: Sequence[str]) -> StagePlan:
    def tp(name: str, v: int, spec: DimSharding) -> TensorPlan:
        s = graph.vars[v]
        return TensorPlan(name, tuple(s.shape), s.dtype, _axis_names(spec))

    inputs = tuple(tp(info.name, v, sp.var_specs[v]) for v, info in zip(graph.invars, infos) if v in sp.var_specs)
    outputs = tuple(tp(name, v, spec) for name, v, spec in zip(out_names, graph.outvars, sp.out_specs) if v in graph.vars)
    mids = []
    for op in graph.ops:
        if op.name in RECORDED_PRIMITIVES:
            for k, v in enumerate(op.outputs):
                if v in sp.var_specs and graph.vars[v].ndim:
                    name = f"{op.name} {sp.op_strategies.get(op.index, '')} {op.source}".strip()
                    mids.append(replace(tp(name, v, sp.var_specs[v]), op=op.index, output=k))
    by_kind: dict[str, float] = {}
    for c in sp.collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.nbytes
    return StagePlan(sp.mesh_shape, AXIS_NAMES, tuple(device_ids), inputs, outputs, tuple(mids),
                     predicted_time_s=sp.objective_s, compute_s=sp.compute_s, comm_s=sp.comm_s, reshard_s=sp.reshard_s,
                     comm_bytes=sp.comm_bytes, memory_bytes=sp.peak_memory_bytes, argument_bytes=sp.argument_bytes,
                     collectives=by_kind, solver_status=sp.solver_status, solve_time_s=sp.solve_time_s)
