"""autopar: automatic parallelization of JAX train steps."""
from autopar.api import Parallelized, make_plan, parallelize
from autopar.attention import causal_attention
from autopar.boundary import mark_stage_boundary
from autopar.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from autopar.cluster import Cluster, LogicalMesh
from autopar.distributed import global_batch
from autopar.intra_op import MemoryBudgetError
from autopar.lost_update import NoUpdateReturnedError
from autopar.methods import DataParallel, Megatron, MeshDivisibilityError, ShardParallel, ZeRO3
from autopar.pipeline import PipeshardParallel, grad, value_and_grad
from autopar.plan import Plan, PlanFileError
from search.database import TuningDB, TuningDBError

__all__ = [
    "CheckpointError", "Cluster", "DataParallel", "LogicalMesh", "Megatron", "MemoryBudgetError", "MeshDivisibilityError",
    "NoUpdateReturnedError", "Parallelized", "PipeshardParallel", "Plan", "PlanFileError", "ShardParallel",
    "TuningDB", "TuningDBError", "ZeRO3", "causal_attention", "global_batch", "grad", "make_plan", "mark_stage_boundary", "parallelize",
    "restore_checkpoint", "save_checkpoint", "value_and_grad",
]
