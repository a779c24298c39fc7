"""Learned cost models for tensor programs: feature vectors and an XGBoost ranking model.
Inputs are plain per-statement feature dicts; this package imports nothing from autopar or search."""
from .features import STATEMENT_FEATURES, feature_matrix, program_vector
from .xgb_model import RandomCostModel, XGBoostCostModel, pairwise_accuracy

__all__ = ["STATEMENT_FEATURES", "feature_matrix", "program_vector", "XGBoostCostModel", "RandomCostModel",
           "pairwise_accuracy"]
