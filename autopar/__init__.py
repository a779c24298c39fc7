"""autopar: automatic parallelization of JAX train steps."""
from autopar.api import Parallelized, parallelize
from autopar.cluster import Cluster, LogicalMesh
from autopar.intra_op import MemoryBudgetError
from autopar.methods import DataParallel, Megatron, MeshDivisibilityError, ShardParallel, ZeRO3
from autopar.plan import Plan, PlanFileError

__all__ = [
    "Cluster", "DataParallel", "LogicalMesh", "Megatron", "MemoryBudgetError", "MeshDivisibilityError",
    "Parallelized", "Plan", "PlanFileError", "ShardParallel", "ZeRO3", "parallelize",
]
