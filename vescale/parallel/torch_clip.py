"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on a vescale-parallel model's
parameters clip as one device's call does.

torch's functions read each parameter's ``.grad`` on this rank. Under vescale that is not
the model's gradient everywhere: ZeRO-2/3 keep this rank's slices of the reduced gradients
in the DDP and leave ``.grad`` None (torch's clip found nothing: norm 0, no clipping, no
error); a pipeline rank holds its stages' gradients only (a per-stage norm); with a loss
scale the gradients are still scaled when the loop clips. So what knows
(``DistributedOptimizer``, ``vescale.parallelize``'s ``ParallelOptimizer``, and a
``PipelineParallel`` for a script's own optimizer) registers its model's parameters here
(read at each call: a plan may replace them later), and once one has, torch's two
functions are wrapped: given
such parameters, they call the owner's global clip (a collective: every rank calls it, as
every rank of a data-parallel loop does); given others, torch's own.

Under ZeRO the optimizer's own parameters (``param_groups``: its master slices, whose
``.grad`` only the step sets) clip the same way, through it.

The parameters must be all of one owner's (``model.parameters()``, as scripts pass them):
a part of them, or them with gradients of another model, raises a ValueError naming the
fix. Code bound to the functions before (``from torch.nn.utils import clip_grad_norm_`` run
before the optimizer was made) keeps torch's own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["register"]

_registered: list = []  # weak references to the owners, in the order they registered
_torch_norm = torch.nn.utils.clip_grad.clip_grad_norm_
_torch_value = torch.nn.utils.clip_grad.clip_grad_value_


def register(owner, parameters: Callable[[], Iterable[torch.Tensor]]) -> None:
    """``owner`` (with ``clip_grad_norm_(max_norm, norm_type)`` and
    ``clip_grad_value_(clip_value)``) clips the gradients of ``parameters()`` from now on,
    read at each call (a plan may replace a model's parameters after the owner is made);
    an owner registered later takes shared parameters over (a pipeline's, then a
    DistributedOptimizer's, then ``vescale.parallelize``'s optimizer)."""
    owner._clipped_parameters = parameters
    _registered.append(weakref.ref(owner))
    _install()


def _claims() -> dict[int, object]:
    """id(parameter) -> its owner now (the latest registered that lists it)."""
    _registered[:] = [r for r in _registered if r() is not None]
    claims: dict[int, object] = {}
    for ref in reversed(_registered):
        owner = ref()
        for p in owner._clipped_parameters():
            claims.setdefault(id(p), owner)
    return claims


def _owner(parameters, what: str):
    """The owner of ``parameters`` (None: torch's own function applies), and the list."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not _registered:
        return None, params
    claims = _claims()
    owners = {id(o): o for p in params if (o := claims.get(id(p))) is not None}
    if not owners:
        return None, params
    owner = next(iter(owners.values()))
    given = {id(p) for p in params}
    owned = {key for key, o in claims.items() if o is owner}
    others = [p for p in params if id(p) not in owned and p.grad is not None]
    if len(owners) > 1 or others or not owned <= given:
        raise ValueError(
            f"torch.nn.utils.{what} got parameters of a vescale-parallel model, but not all of one model's "
            "alone: its gradients live sharded across ranks (ZeRO-2/3 slices, pipeline stages), and vescale "
            "clips them by the global norm of the whole model at once. Pass model.parameters() of that model "
            f"only, or call the optimizer's {what} (vescale.parallelize's optimizer, or DistributedOptimizer)")
    return owner, params


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    owner, params = _owner(parameters, "clip_grad_norm_")
    if owner is None:
        return _torch_norm(params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = owner.clip_grad_norm_(max_norm, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return norm


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    owner, params = _owner(parameters, "clip_grad_value_")
    if owner is None:
        return _torch_value(params, clip_value, foreach)
    owner.clip_grad_value_(clip_value)
    return None


clip_grad_norm_.__doc__ = _torch_norm.__doc__
clip_grad_value_.__doc__ = _torch_value.__doc__


def _install() -> None:
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
