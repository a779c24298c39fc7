"""Tensor-program search (Ansor-style): compute definitions, schedules, sketches, evolutionary
search with a learned cost model, C/OpenMP or Pallas code generation and measurement, tuning
records."""
from .record import TuningRecord
from .schedule import ScheduleError
from .task import Task
from .task_scheduler import tune_tasks
from .tune import Kernel, TuneResult, best_schedule, build, tune

__all__ = ["Task", "tune", "build", "TuneResult", "Kernel", "tune_tasks", "best_schedule", "TuningRecord",
           "ScheduleError"]
