"""Makes DTensor's methods reachable on every tensor backed by a DTensorImpl.

Op results are created in C++ below Python, so their Python class is plain
``torch.Tensor``; turning each into a ``DTensor`` object would put Python back on
every op. Instead three narrow hooks go on ``torch.Tensor``:

* ``__getattr__`` (only consulted when normal lookup fails, so plain tensors pay
  nothing) resolves ``to_local``, ``placements``, ``device_mesh``... on DTensors;
* ``__repr__`` prints a DTensor's local shard and layout without communicating
  (printing the global values would be a collective, and deadlock if one rank prints);
* ``data_ptr`` names the problem and the fix instead of torch's generic error.
"""

from __future__ import annotations

import torch

from . import _C
from .dtensor import DTensor

_DTENSOR_ATTRS = {name: DTensor.__dict__[name] for name in
                  ("to_local", "full_tensor", "redistribute", "placements", "device_mesh", "_local_tensor")}


def _getattr(self, name):
    attr = _DTENSOR_ATTRS.get(name)
    if attr is not None and _C.is_dtensor(self):
        return attr.__get__(self, type(self))
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


def _install() -> None:
    if getattr(torch.Tensor, "_vescale_installed", False):
        return
    torch.Tensor._vescale_installed = True
    torch.Tensor.__getattr__ = _getattr

    plain_repr = torch.Tensor.__repr__

    def __repr__(self, *args, **kwargs):
        if _C.is_dtensor(self):
            return (f"DTensor(local_tensor={_C.local_tensor(self)!r}, device_mesh={self.device_mesh}, "
                    f"placements={self.placements}, shape={tuple(self.shape)})")
        return plain_repr(self, *args, **kwargs)

    torch.Tensor.__repr__ = __repr__

    plain_data_ptr = torch.Tensor.data_ptr

    def data_ptr(self):
        if _C.is_dtensor(self):
            raise RuntimeError(
                f"data_ptr() is not defined for a DTensor ({self.placements} on {self.device_mesh}): it owns "
                f"no storage of its own; use .to_local().data_ptr() for this rank's shard")
        return plain_data_ptr(self)

    torch.Tensor.data_ptr = data_ptr
