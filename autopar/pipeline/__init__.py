"""Pipeline parallelism (`PipeshardParallel`): stages on submeshes, 1F1B/GPipe schedules."""
from autopar.boundary import mark_stage_boundary
from autopar.pipeline.api import (PipeshardExecutable, build_pipeshard, plan_pipeshard, plan_to_dict,
                                  trace_step)
from autopar.pipeline.grad import grad, value_and_grad
from autopar.pipeline.method import PipeshardParallel
from autopar.pipeline.stage_cost import StageCost

__all__ = ["PipeshardExecutable", "PipeshardParallel", "StageCost", "build_pipeshard", "grad",
           "mark_stage_boundary", "plan_pipeshard", "plan_to_dict", "trace_step", "value_and_grad"]
