"""Module-level parallelism: sharding plans, data parallelism, ZeRO."""

from .ddp import DDP
from .optimizer import DistributedOptimizer
from .parallelize import parallelize_module

__all__ = ["parallelize_module", "DDP", "DistributedOptimizer"]
