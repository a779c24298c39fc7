"""rockmate package."""
