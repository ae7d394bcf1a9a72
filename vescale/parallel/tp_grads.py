"""Tensor-parallel gradients reduced in buckets, as DDP reduces data-parallel ones.

A parameter replicated over a mesh dim gets a gradient that is Partial over that dim:
each rank holds its part of the sum (a LayerNorm weight under sequence parallelism, the
bias of a row-parallel Linear, a weight tied across a column- and a row-parallel use).
Left alone, the engine's leaf hook all-reduces each such gradient by itself as it
arrives. ``PartialGradients`` (installed by ``parallelize_module``) keeps them Partial
instead and reduces them together: parameters are grouped into buckets in reverse
registration order (``bucket_cap_mb`` each), a bucket's all-reduce starts as soon as its
last gradient is accumulated, overlapping the rest of backward, and the end of backward
waits for every bucket and relabels each gradient with its parameter's placements.

Under ``DDP`` the data-parallel wrapper drives the reduction (``DDP`` adopts every
``PartialGradients`` of its module): when the data- and tensor-parallel groups together
are the whole world, a bucket's Partial gradients are summed over both by one all-reduce
through the world group; otherwise the DP reduction runs first and the TP one after, one
collective per bucket each. Gradient accumulation under ``no_sync`` keeps them Partial
until the step that reduces.

While backward runs, a post-accumulate-grad hook of the user's may see such a gradient
Partial (``full_tensor()`` gives its value); after backward every gradient has its
parameter's placements, as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C, _trace
from .._local import local_of
from ..deferred import is_deferred

__all__ = ["PartialGradients", "partial_dims", "partial_gradients_of", "launch_partial_sums", "land",
           "sum_over_dims", "copy_back"]


_claimed: "weakref.WeakSet[nn.Parameter]" = weakref.WeakSet()


def partial_dims(t: torch.Tensor) -> tuple[int, ...]:
    """The mesh dims (of more than one rank) over which ``t`` is a Partial sum."""
    mesh = t.device_mesh
    return tuple(d for d, p in enumerate(t.placements)
                 if p.is_partial() and p.reduce_op == "sum" and mesh.size(d) > 1)


def _replicated_somewhere(p: nn.Parameter) -> bool:
    """Whether ``p`` may get a Partial gradient: a DTensor replicated over a mesh dim of
    more than one rank."""
    if not (p.requires_grad and _C.is_dtensor(p)):
        return False
    return any(pl.is_replicate() and p.device_mesh.size(d) > 1 for d, pl in enumerate(p.placements))


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    pending: int = 0
    launched: list = field(default_factory=list)  # what launch_partial_sums returned, until landed


class PartialGradients:
    """Bucketed reduction of the Partial gradients of a module's replicated DTensor
    parameters (see the module docstring). ``parallelize_module`` installs one per call
    (``PartialGradients.install``); ``partial_gradients_of(model)`` finds them."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], *, bucket_cap_mb: float = 25.0):
        self.params = params
        self.buckets = _buckets(params, int(bucket_cap_mb * 2**20))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.driver = None  # the DDP that reduces these gradients, once adopted
        self._callback_queued = False
        self.last_reduced: list[nn.Parameter] = []  # whose gradients the last backward summed
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._mark_when_materialised(module)

    @classmethod
    def install(cls, module: nn.Module, **kwargs) -> "PartialGradients | None":
        """For ``module``'s replicated DTensor parameters not yet handled by another
        (a module parallelized twice); None when there are none."""
        params = [p for p in module.parameters() if p not in _claimed and _replicated_somewhere(p)]
        if not params:
            return None
        _claimed.update(params)
        reducer = cls(module, params, **kwargs)
        # a plain attribute, not a submodule; a module parallelized twice holds both
        object.__setattr__(module, "_partial_gradients", module.__dict__.get("_partial_gradients", ()) + (reducer,))
        return reducer

    def _mark_when_materialised(self, module: nn.Module) -> None:
        """Tells the engine to leave these gradients Partial. The flag lives on the
        parameter's tensor, which materialising a vescale.deferred_init model replaces:
        each owner module marks its parameters before its first forward with values,
        then drops its hook."""
        mine = {id(p) for p in self.params}
        for owner in module.modules():
            names = [n for n, p in owner._parameters.items() if p is not None and id(p) in mine]
            if names:
                _mark_before_forward(owner, names)

    # ---- backward, when no DDP drives ----

    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.driver is not None:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            for b in self.buckets:
                b.pending = len(b.params)
        b = self._bucket_of[id(param)]
        b.pending -= 1
        if b.pending == 0:
            self.launch(b.params, b)

    def launch(self, params: list[nn.Parameter], bucket: _Bucket) -> None:
        bucket.launched += launch_partial_sums(params)

    def finish(self) -> None:
        """Waits for every bucket (launching those whose gradients did not all arrive),
        writes the sums back and gives each gradient its parameter's placements."""
        self._callback_queued = False
        self.last_reduced = []
        for b in self.buckets:
            if b.pending:
                self.launch(b.params, b)
            b.pending = 0
            self.last_reduced += [p for _, _, ps, _ in b.launched for p in ps]
            land(b.launched)


def launch_partial_sums(params, *, over_world: bool = False, divide_by: int = 1) -> list:
    """Starts the all-reduce of ``params``' Partial gradients, one per set of Partial
    mesh dims (normally one): through the world group when ``over_world`` (the caller
    knows that it spans those dims and the data-parallel one, and divides by the
    data-parallel size) or when they are Partial over all of a mesh that spans the world;
    else over the first dim now and the others when landed. ``divide_by`` divides before
    the sum, as torch's DDP does: an fp16 sum of scaled gradients may overflow where their
    average does not. Returns what ``land`` takes."""
    by_dims: dict[tuple, list] = {}
    for p in params:
        if p.grad is not None and _C.is_dtensor(p.grad):
            dims = partial_dims(p.grad)
            if dims:
                by_dims.setdefault((_C.mesh_of(p), dims), []).append(p)
    launched = []
    for (_, dims), ps in by_dims.items():
        buffer = torch.cat([local_of(p.grad).reshape(-1) for p in ps])
        if divide_by != 1:
            buffer.div_(divide_by)
        mesh = ps[0].device_mesh
        if over_world or (len(dims) > 1 and len(dims) == sum(s > 1 for s in mesh.shape) and mesh._c.flat_group_name):
            group, rest = dist.group.WORLD, ()
        else:
            group, rest = mesh.get_group(dims[0]), dims[1:]
        token = _trace.collective_started("all_reduce", group, buffer, source="tp")
        work = _trace.traced(dist.all_reduce(buffer, group=group, async_op=True), token)
        launched.append((work, buffer, ps, rest))
    return launched


def land(launched: list) -> None:
    """Waits for ``launch_partial_sums``' collectives (running the remaining dims' ones),
    writes each sum back into its gradient's shard and relabels the gradient with its
    parameter's placements. Empties ``launched``."""
    for work, buffer, ps, rest in launched:
        work.wait()
        sum_over_dims(buffer, ps[0].device_mesh, rest)
        copy_back(buffer, [local_of(p.grad) for p in ps])
        for p in ps:
            _C.relabel(p.grad, _C.placements_of(p))
    launched.clear()


def sum_over_dims(buffer: torch.Tensor, mesh, dims) -> None:
    """All-reduces ``buffer`` in place over each of ``mesh``'s ``dims`` in turn."""
    for d in dims:
        group = mesh.get_group(d)
        _trace.call("all_reduce", group, buffer, dist.all_reduce, buffer, group=group, source="tp")


def copy_back(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copies the flat ``buffer`` (the tensors back to back) into ``tensors``."""
    for t, piece in zip(tensors, buffer.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


def _mark_before_forward(owner: nn.Module, names: list[str]) -> None:
    def mark(mod, args):
        # (a pipeline stage's parameters held elsewhere are plain placeholders)
        params = [p for p in (mod._parameters[n] for n in names) if p is not None and _C.is_dtensor(p)]
        waiting = [p for p in params if is_deferred(local_of(p))]  # (a deferred shard is meta)
        for p in params:
            if not is_deferred(local_of(p)):
                _C.defer_partial_grads(p)
        if not waiting:
            handle.remove()

    handle = owner.register_forward_pre_hook(mark)


def partial_gradients_of(module: nn.Module) -> list[PartialGradients]:
    """Every PartialGradients installed on ``module`` or its submodules."""
    found = []
    for m in module.modules():
        found += [r for r in m.__dict__.get("_partial_gradients", ()) if r not in found]
    return found


def _buckets(params: list[nn.Parameter], cap: int) -> list[_Bucket]:
    """Reverse registration order (gradients arrive roughly so), one dtype and mesh per
    bucket, at most ``cap`` bytes of local shards each."""
    buckets: list[_Bucket] = []
    open_buckets: dict[tuple, tuple[_Bucket, int]] = {}
    for p in reversed(params):
        local = local_of(p)
        key = (local.dtype, local.device, _C.mesh_of(p))
        b, used = open_buckets.get(key, (None, 0))
        nbytes = local.numel() * local.element_size()
        if b is None or used + nbytes > cap and b.params:
            b, used = _Bucket([]), 0
            buckets.append(b)
        b.params.append(p)
        open_buckets[key] = (b, used + nbytes)
    return buckets
