"""Pure cost functions (no torch): compute, communication, memory, schedules, whole plans."""
from .evaluate import evaluate, stage_memory
from .schedule import Event, ScheduleResult, in_flight, simulate

__all__ = ["evaluate", "stage_memory", "simulate", "in_flight", "Event", "ScheduleResult"]
