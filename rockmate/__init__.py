"""rockmate: activation rematerialization for JAX (Rockmate: block ILP + sequence DP)."""
from .api import RematFunction, apply_plan, block, min_budget, plan_remat, remat
from .budget import parse_bytes
from .plan import BlockChoice, InfeasibleBudgetError, RematPlan

__all__ = ["remat", "plan_remat", "apply_plan", "min_budget", "block", "RematPlan", "BlockChoice",
           "RematFunction", "InfeasibleBudgetError", "parse_bytes"]
