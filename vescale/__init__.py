"""vescale: train unmodified PyTorch models on a device mesh.

The everyday names live here; sub-modules hold the rest.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from . import _compile
from ._tensor_methods import _install
from .debug import collective_counts, debug_mode, fallback_counts, reset_collective_counts, reset_fallback_counts
from ._explain import explain
from .device_mesh import DeviceMesh, get_device_mesh, init_device_mesh
from .dtensor import DTensor, distribute_tensor
from .placement_types import InterleavedShard, Partial, Placement, Replicate, Shard
from .parallel import DDP, DistributedOptimizer, parallelize_module
from .checkpoint import load, save
from .data import DataLoader
from .deferred import deferred_init, materialize_module
from .plan import Plan, PlanError
from .train import parallelize
from .autoplan.eager import generate_plan

_install()
_compile.install()

__all__ = [
    "DeviceMesh", "init_device_mesh", "get_device_mesh",
    "DTensor", "distribute_tensor",
    "Placement", "Shard", "Replicate", "Partial", "InterleavedShard",
    "fallback_counts", "reset_fallback_counts", "collective_counts", "reset_collective_counts", "debug_mode",
    "explain",
    "parallelize_module", "DDP", "DistributedOptimizer",
    "save", "load", "deferred_init", "materialize_module",
    "DataLoader",
    "Plan", "PlanError", "parallelize", "generate_plan",
]
