"""Tuned kernels inside the per-stage pipeline. A stage evaluates each of its layers' train
graphs (forward and backward ops, recomputation included) op by op under the layouts the
layer's ILP chose, so every local matmul of a layer is a site exactly as in a single-stage
program: the same tasks, the same head-to-head choice, the same op override."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.kernel_choice import ChosenKernels, SiteGroup, choose_group_kernels
from autopar.kernel_sites import kernel_tasks, kernel_sites


def stage_site_groups(stage: Any, layouts: Any, mesh_shape: tuple[int, int]) -> list[SiteGroup]:
    """One SiteGroup per layer of `stage` (a StageLayers), at the local shapes of its
    logical mesh under each layer's layouts."""
    return [SiteGroup(graph=lg.graph, sites=tuple(kernel_sites(lg.graph, dict(c.var_specs), mesh_shape)),
                      layer=lg.spec.index) for lg, c in zip(stage.layers, layouts)]


def with_stage_kernels(planned: Any, request: Any) -> Any:
    """`planned` (a PipelinePlanned) with every stage's kernel tasks recorded and, with
    `request.kernels` != "xla", kernels chosen for its layers' sites (`planned.kernels`:
    per stage, per layer, a ChosenKernels)."""
    groups = [stage_site_groups(st.layers, st.layouts, st.logical_mesh) for st in planned.stages]
    stages = [replace(s, kernel_tasks=kernel_tasks([x for g in gs for x in g.sites]))
              for s, gs in zip(planned.plan.stages, groups)]
    chosen: tuple[tuple[ChosenKernels, ...], ...] = ()
    if request.kernels != "xla" and request.devices is not None:
        flat = iter(choose_group_kernels([g for gs in groups for g in gs], request.kernels, request.tuning_trials,
                                         request.tuning_db))
        chosen = tuple(tuple(next(flat) for _ in gs) for gs in groups)
        stages = [replace(s, kernels=tuple(u for c in per_layer for u in c.uses))
                  for s, per_layer in zip(stages, chosen)]
    return replace(planned, plan=replace(planned.plan, stages=tuple(stages)), kernels=chosen)
