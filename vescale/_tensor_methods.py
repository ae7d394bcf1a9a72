"""Makes DTensor's methods reachable on every tensor backed by a DTensorImpl.

Op results are created in C++ below Python, so their Python class is plain
``torch.Tensor``; turning each into a ``DTensor`` object would put Python back on
every op. Instead a few narrow hooks go on ``torch.Tensor``:

* ``__getattr__`` (only consulted when normal lookup fails, so plain tensors pay
  nothing) resolves ``to_local``, ``placements``, ``device_mesh``... on DTensors;
* ``__repr__`` prints a DTensor's local shard and layout without communicating
  (printing the global values would be a collective, and deadlock if one rank prints);
* ``data_ptr``, ``tolist``, ``numpy`` and ``__array__`` name the problem and the fix
  instead of torch's generic "doesn't have storage" error;
* ``new_tensor`` and the legacy ``new`` build a plain tensor on the local device, as they
  do for torch's DTensor: torch picks their device from the tensor's dispatch key, which
  is vescale's own and names no device, so they failed (``nn.init.trunc_normal_`` calls
  ``new_tensor``, so a torchtitan-style init of a DTensor parameter failed with them);
* ``__deepcopy__`` clones a DTensor (same mesh and placements) where torch's would copy
  its storage, which a DTensor does not have (``copy.deepcopy(model)`` of a parallelized
  model, e.g. for an EMA copy, failed).
"""

from __future__ import annotations

import copy

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

    for name, fix in (("data_ptr", ".to_local().data_ptr() for this rank's shard"),
                      ("tolist", ".full_tensor().tolist() (a collective: every rank must call it)"),
                      ("numpy", ".full_tensor().numpy() (a collective) or .to_local().numpy() for this rank's shard"),
                      ("__array__", "np.asarray(x.full_tensor()) (a collective) or np.asarray(x.to_local())")):
        setattr(torch.Tensor, name, _refused_on_dtensors(getattr(torch.Tensor, name), name, fix))

    torch.Tensor.__deepcopy__ = _deepcopy_dtensors(torch.Tensor.__deepcopy__)

    for name in ("new_tensor", "new"):
        setattr(torch.Tensor, name, _plain_on_dtensors(getattr(torch.Tensor, name)))


def _refused_on_dtensors(plain, name, fix):
    def method(self, *args, **kwargs):
        if _C.is_dtensor(self):
            raise RuntimeError(f"{name}() reads the storage of one tensor, and a DTensor ({self.placements} on "
                               f"{self.device_mesh}) owns none: its data is spread over ranks; use {fix}")
        return plain(self, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = plain.__doc__
    return method


def _plain_on_dtensors(plain):
    def method(self, *args, **kwargs):
        if _C.is_dtensor(self):
            self = torch.empty(0, dtype=self.dtype, device=self.device)  # the defaults: dtype, local device
        return plain(self, *args, **kwargs)
    method.__name__ = plain.__name__
    method.__doc__ = plain.__doc__
    return method


def _deepcopy_dtensors(plain):
    def __deepcopy__(self, memo):
        # Non-leaves go to torch's, which refuses them with its own message.
        if not _C.is_dtensor(self) or not self.is_leaf:
            return plain(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        if self.__dict__:  # Python attributes set on the tensor, as torch copies them
            new.__dict__ = copy.deepcopy(self.__dict__, memo)
        memo[id(self)] = new
        return new
    return __deepcopy__
