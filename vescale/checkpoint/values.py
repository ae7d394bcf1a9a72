"""The non-tensor part of a checkpoint (scheduler state, optimizer hyperparameters, RNG
state, loss scale, the user's Python values) without pickle: unpickling runs whatever
code the file names, so a checkpoint from elsewhere could take over the machine.

Values become JSON. Tuples, dicts with keys other than strings, and tensors become
tagged objects ``{"__vescale__": kind, ...}``, a tensor referring by index to a list
of tensors stored next to the JSON, so that everything comes back with its type
(tensors on the CPU).
Anything else is refused when saving, naming where it is.
"""

from __future__ import annotations

import torch

TAG = "__vescale__"
_SCALARS = (type(None), bool, int, float, str)  # exact types: a subclass would come back as its base
SUPPORTED = ("tensors, None, bool, int, float, str, and lists, tuples and dicts of them "
             "(dict keys: None, bool, int, float or str)")

__all__ = ["encode", "decode", "SUPPORTED"]


def encode(values: dict[str, object]) -> tuple[dict, list[torch.Tensor]]:
    """(JSON-ready values, the tensors they refer to). Raises TypeError naming the first
    value that cannot be stored."""
    tensors: list[torch.Tensor] = []

    def enc(v, where: str):
        if type(v) in _SCALARS:
            return v
        if type(v) is list:
            return [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if type(v) is tuple:
            return {TAG: "tuple", "items": [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if type(v) is dict:
            for k in v:
                if type(k) not in _SCALARS:
                    _refuse(k, f"a key of {where}")
            items = {k: enc(x, f"{where}[{k!r}]") for k, x in v.items()}
            if all(type(k) is str for k in items) and TAG not in items:
                return items
            return {TAG: "dict", "items": [[k, x] for k, x in items.items()]}
        if type(v) in (torch.Tensor, torch.nn.Parameter):
            tensors.append(v.detach().cpu())
            return {TAG: "tensor", "index": len(tensors) - 1}
        _refuse(v, where)

    return {k: enc(v, repr(k)) for k, v in values.items()}, tensors


def _refuse(v, where: str):
    kind = f"{type(v).__module__}.{type(v).__qualname__}"
    hint = (" (a DTensor or other tensor subclass: put it at the top level of the state dict, where tensors are "
            "saved sharded)" if isinstance(v, torch.Tensor) else
            "; save its state_dict() (a module, optimizer or scheduler at the top level is saved that way) or "
            "convert it to those types")
    raise TypeError(f"cannot save {where}: a {kind}. Checkpoints store {SUPPORTED}, never pickled objects, "
                    f"since loading a pickle can run arbitrary code{hint}")


def decode(value, tensors: list[torch.Tensor]):
    """The values ``encode`` gave, with tensor references replaced by ``tensors``.
    Raises ValueError on anything ``encode`` does not write."""
    if type(value) is list:
        return [decode(x, tensors) for x in value]
    if type(value) is not dict:
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode(x, tensors) for k, x in value.items()}
    if kind == "tuple":
        return tuple(decode(x, tensors) for x in value["items"])
    if kind == "dict":
        return {_key(k): decode(x, tensors) for k, x in value["items"]}
    if kind == "tensor":
        return tensors[value["index"]]
    raise ValueError(f"unknown tagged value {kind!r}")


def _key(k):
    if type(k) not in _SCALARS:
        raise ValueError(f"a dict key {k!r} that encode does not write")
    return k
