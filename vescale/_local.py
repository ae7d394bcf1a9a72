"""``local_of``: the tensor a rank holds. At the bottom of the Python layers (it needs only
the engine), so that deferred init, DDP, ZeRO, the pipeline and the debug tools share it
without importing one another."""

from __future__ import annotations

import torch

from . import _C


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank actually holds: a DTensor's shard, or a plain tensor itself."""
    return _C.local_tensor(t) if _C.is_dtensor(t) else t
