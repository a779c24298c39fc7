"""cost_model package."""
