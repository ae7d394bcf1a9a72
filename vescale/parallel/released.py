"""A ZeRO-3 parameter whose storage is emptied raises a clear error when a script reads
or writes it, instead of handing torch's kernels a null data pointer (which they do not
check: ``p.clone()``, ``p.norm()`` or an EMA's ``lerp_`` killed the process with SIGSEGV).

Emptying keeps the parameter object (optimizers, hooks and autograd's saved references
hold it), so the guard changes only its Python class, to a subclass whose
``__torch_function__`` lets through what reads no values (shape, dtype, ``.grad``,
``requires_grad_``, hooks) and raises on everything else. Gathering the parameter
restores its class: forward and backward run on the plain parameter, and no op pays for
the guard there.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

__all__ = ["guard", "unguard", "is_guarded"]

# what a script or torch may touch on an empty parameter: metadata, the gradient, hooks
# and the storage object (empty: reads through it are bounds-checked)
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim", "layout", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize",
    "_version", "_base", "_backward_hooks", "_post_accumulate_grad_hooks",
    "size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous", "storage_offset",
    "get_device", "is_floating_point", "is_complex", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__len__", "__hash__", "untyped_storage", "data_ptr", "nbytes",
    "view_as",  # torch.distributed.pipelining reaches a parameter's AccumulateGrad node through p.view_as(p)
    "output_nr",  # torch.autograd.graph.get_gradient_edge (DDP asks whether backward reaches the parameter)
})

_names: dict[int, str] = {}  # id(parameter) -> its name in the model, for the message


def name(param: nn.Parameter, as_named: str) -> None:
    """Records the parameter's name in the model, for the error message."""
    _names[id(param)] = as_named


def _what(func) -> str:
    """The attribute or function ``func`` stands for (a property's getter and setter are
    ``__get__`` / ``__set__`` of a descriptor named after it)."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") in ("__get__", "__set__") and owner is not None:
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


class _Released:
    """Mixed into the parameter's own class while its storage is empty."""
    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _what(func) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        param = next((a for a in args if isinstance(a, _Released)), None)
        raise RuntimeError(_message(param, _what(func) or repr(func)))

    def __repr__(self) -> str:
        return f"{_name_of(self)} (ZeRO-3, empty between steps: shape {tuple(self.shape)}, {self.dtype})"


def _name_of(param) -> str:
    named = _names.get(id(param))
    return f"parameter '{named}'" if named else "a parameter"


def _message(param, call: str) -> str:
    shape = f" of shape {tuple(param.shape)}" if param is not None else ""
    return (f"{call}() reads or writes {_name_of(param)}{shape}, which ZeRO-3 keeps as each data-parallel "
            "rank's slice and empties between steps (torch's kernels would read a null pointer). On every DP "
            "rank, wrap the code in `with optimizer.full_parameters():`, where the parameters are whole and "
            "writes to them are kept; or read the whole state with vescale.checkpoint.full_state_dict(...)")


@functools.cache
def _released_class(cls: type) -> type:
    return type(f"Released{cls.__name__}", (_Released, cls), {"__slots__": ()})


def is_guarded(param: torch.Tensor) -> bool:
    return isinstance(param, _Released)


def guard(param: nn.Parameter) -> None:
    """From now on reading ``param``'s values raises (its storage is being emptied)."""
    if not isinstance(param, _Released):
        param.__class__ = _released_class(type(param))


def unguard(param: nn.Parameter) -> None:
    """``param`` is plain again (its storage is about to be filled)."""
    if isinstance(param, _Released):
        param.__class__ = type(param).__mro__[2]  # (Released<cls>, _Released, cls, ...)
