"""Pipeline parallelism for unmodified models, in eager mode, without a model graph."""

from .engine import PipelineParallel
from .schedules import SCHEDULES, analytic_bubble, make_schedule, simulate
from .split import PipelineSplitError
from .stage import is_elsewhere

__all__ = ["PipelineParallel", "PipelineSplitError", "SCHEDULES", "make_schedule", "simulate", "analytic_bubble",
           "is_elsewhere"]
