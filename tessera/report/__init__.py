"""Plans and runs for people: rich tables (`tables`) and matplotlib pictures (`plots`, imported lazily)."""
from .tables import comparison_table, layer_groups, render_plan

__all__ = ["comparison_table", "layer_groups", "render_plan"]
