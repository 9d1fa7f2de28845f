"""The static planner: the fastest hybrid-parallel plan that fits memory (no torch)."""
from .baselines import baseline_plans, manual_plan
from .planner import NoFeasiblePlanError, search
from .space import SearchOptions

__all__ = ["search", "SearchOptions", "NoFeasiblePlanError", "manual_plan", "baseline_plans"]
