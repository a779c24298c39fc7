"""autopar: automatic parallelization of JAX train steps."""
from autopar.api import Parallelized, make_plan, parallelize
from autopar.cluster import Cluster, LogicalMesh
from autopar.intra_op import MemoryBudgetError
from autopar.methods import DataParallel, Megatron, MeshDivisibilityError, ShardParallel, ZeRO3
from autopar.plan import Plan, PlanFileError
from search.database import TuningDB, TuningDBError

__all__ = [
    "Cluster", "DataParallel", "LogicalMesh", "Megatron", "MemoryBudgetError", "MeshDivisibilityError",
    "Parallelized", "Plan", "make_plan", "PlanFileError", "ShardParallel", "TuningDB", "TuningDBError", "ZeRO3", "parallelize",
]
