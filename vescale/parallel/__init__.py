"""Module-level parallelism: sharding plans, data parallelism, ZeRO, pipeline."""

from .ddp import DDP
from .optimizer import DistributedOptimizer
from .parallelize import parallelize_module
from .pipeline import PipelineParallel, PipelineSplitError

__all__ = ["parallelize_module", "DDP", "DistributedOptimizer", "PipelineParallel", "PipelineSplitError"]
