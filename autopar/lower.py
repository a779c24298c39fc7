"""Lower a sharding plan to one jitted SPMD program: NamedShardings in and out, and a
`with_sharding_constraint` on every planned intermediate so XLA follows the plan."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rockmate.graph.evaluate import eval_graph
from rockmate.graph.op_graph import OpGraph
from autopar.intra_op import ShardingPlan
from autopar.sharding_spec import AXIS_NAMES, DimSharding, replicated, to_partition_spec


def build_mesh(devices: Sequence[Any], mesh_shape: tuple[int, int]) -> Mesh:
    """A 2-D mesh with Auto axis types (GSPMD propagation between our constraints)."""
    devs = np.asarray(list(devices), dtype=object)
    if devs.size != mesh_shape[0] * mesh_shape[1]:
        raise ValueError(f"mesh {mesh_shape} needs {mesh_shape[0] * mesh_shape[1]} devices, got {devs.size}")
    return Mesh(devs.reshape(mesh_shape), AXIS_NAMES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def named(mesh: Mesh, spec: DimSharding) -> NamedSharding:
    return NamedSharding(mesh, to_partition_spec(spec))


def input_shardings(graph: OpGraph, plan: ShardingPlan, mesh: Mesh) -> tuple[NamedSharding, ...]:
    """Where each flat input of the graph lives under `plan` (replicated where it has no spec)."""
    return tuple(named(mesh, plan.var_specs.get(v, replicated(len(graph.vars[v].shape)))) for v in graph.invars)


def sharded_function(graph: OpGraph, plan: ShardingPlan, mesh: Mesh, donate_flat: Sequence[int] = (),
                     constrain_intermediates: bool = True, overrides: dict | None = None):
    """jax.jit of the graph over flat arguments, following `plan` on `mesh`; `overrides`
    (op index -> function of its inputs) replace ops, e.g. by tuned kernels."""
    in_shardings = tuple(named(mesh, plan.var_specs[v]) if v in plan.var_specs else None for v in graph.invars)
    out_shardings = tuple(named(mesh, s) for s in plan.out_specs)
    specs = plan.var_specs

    def hook(op, vid, value):
        spec = specs.get(vid)
        if spec is None or not getattr(value, "ndim", 0):
            return value
        return jax.lax.with_sharding_constraint(value, named(mesh, spec))

    def flat_fn(*flat_args):
        return tuple(eval_graph(graph, flat_args, on_output=hook if constrain_intermediates else None,
                                overrides=overrides))

    return jax.jit(flat_fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=tuple(donate_flat))
