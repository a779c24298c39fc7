"""Pipeline parallelism (`PipeshardParallel`): stages of layers on submeshes, each sharded
by the intra-op ILP, run with a 1F1B or GPipe schedule."""
from autopar.boundary import mark_stage_boundary
from autopar.pipeline.grad import grad, value_and_grad
from autopar.pipeline.method import PipeshardParallel

__all__ = ["PipeshardParallel", "grad", "mark_stage_boundary", "value_and_grad"]
