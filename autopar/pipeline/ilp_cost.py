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

    def __call__(self, eqn_range: tuple[int, int], submesh: tuple[int, int],
                 logical_mesh: tuple[int, int]) -> Any:
        key = (tuple(eqn_range), tuple(submesh), tuple(logical_mesh))
        if key not in self.cache:
            self.cache[key] = self._solve(eqn_range, logical_mesh)
        return self.cache[key]

    def _solve(self, eqn_range, logical_mesh):
        from autopar.graph.trace import trace_graph
        from autopar.intra_op import MemoryBudgetError, plan_sharding

        fn, args = stage_train_function(self.loss_jaxpr, eqn_range, self.diff_mask)
        graph = trace_graph(fn, *args)
        mesh = self.cluster.logical_mesh(tuple(logical_mesh))
        try:
            sp = plan_sharding(graph, mesh, memory_budget_bytes=self.memory_budget_bytes,
                               time_limit_s=self.time_limit_s, solver=self.solver)
        except MemoryBudgetError:
            return StageCost(math.inf)
        return (sp.objective_s, sp.peak_memory_bytes)
