"""The static planner: the fastest hybrid-parallel plan that fits memory (no torch)."""
from .baselines import baseline_plans, manual_plan

__all__ = ["baseline_plans", "manual_plan"]
