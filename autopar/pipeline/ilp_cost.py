"""Stage cost from the intra-op ILP: the candidate stage's forward + backward traced into
an op graph and sharded by `autopar.intra_op.plan_sharding` on the logical mesh."""
from __future__ import annotations

import math
from typing import Any, Sequence

from autopar.pipeline.split import stage_train_function
from autopar.pipeline.stage_cost import StageCost


class IntraOpStageCost:
    """`stage_cost_fn(eqn_range, submesh, logical_mesh) -> (time_s, memory_bytes)` priced
    by the intra-op ILP (per micro-batch; memory with one micro-batch in flight), cached."""

    def __init__(self, loss_jaxpr: Any, diff_mask: Sequence[bool], cluster: Any,
                 memory_budget_bytes: float = math.inf, time_limit_s: float = 10.0,
                 solver: str = "highs"):
        self.loss_jaxpr, self.diff_mask, self.cluster = loss_jaxpr, list(diff_mask), cluster
        self.memory_budget_bytes, self.time_limit_s, self.solver = memory_budget_bytes, time_limit_s, solver
        self.cache: dict[tuple, Any] = {}
        self.param_layouts: dict[tuple, list[Any]] = {}   # key -> ILP DimSharding per stage param

    def __call__(self, eqn_range: tuple[int, int], submesh: tuple[int, int],
                 logical_mesh: tuple[int, int]) -> Any:
        key = (tuple(eqn_range), tuple(submesh), tuple(logical_mesh))
        if key not in self.cache:
            self.cache[key] = self._solve(key, eqn_range, logical_mesh)
        return self.cache[key]

    def param_sharding_fn_for(self, plan: Any):
        """`param_sharding_fn` placing each stage's parameters as the ILP planned them
        for the chosen (layer range, submesh, logical mesh)."""
        from jax.sharding import PartitionSpec

        from autopar.pipeline.split import split_loss

        names = ("data", "model")
        jaxpr = self.loss_jaxpr.jaxpr
        specs = split_loss(jaxpr, plan.stage_eqn_cuts, self.diff_mask)
        layouts = {}
        for s, ((a, b), sub, lm) in enumerate(zip(plan.stage_layers, plan.submeshes, plan.logical_meshes)):
            key = ((plan.layer_cuts[a], plan.layer_cuts[b]), tuple(sub), tuple(lm))
            for leaf, dims in zip(specs[s].param_leaves, self.param_layouts.get(key, [])):
                layouts[(s, leaf)] = PartitionSpec(*[
                    None if not axes else (names[axes[0]] if len(axes) == 1 else tuple(names[x] for x in axes))
                    for axes in dims])
        return lambda stage, leaf, aval, mesh: layouts.get((stage, leaf), PartitionSpec())

    def _solve(self, key, eqn_range, logical_mesh):
        from rockmate.graph.trace import trace_graph
        from autopar.intra_op import MemoryBudgetError, plan_sharding

        fn, args = stage_train_function(self.loss_jaxpr, eqn_range, self.diff_mask)
        graph = trace_graph(fn, *args)
        mesh = self.cluster.logical_mesh(tuple(logical_mesh))
        try:
            sp = plan_sharding(graph, mesh, memory_budget_bytes=self.memory_budget_bytes,
                               time_limit_s=self.time_limit_s, solver=self.solver)
        except MemoryBudgetError:
            return StageCost(math.inf)
        num_params = len(args[0])
        self.param_layouts[key] = [sp.var_specs.get(v, ()) for v in graph.invars[:num_params]]
        return (sp.objective_s, sp.peak_memory_bytes)
