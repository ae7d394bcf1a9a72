"""DDP: data parallelism over one mesh dim, for plain and tensor-parallel DTensor models.

    model = DDP(parallelize_module(model, mesh["TP"], plan), mesh["DP"])

Each data-parallel rank runs its own micro-batch; gradients are averaged over the DP
group as backward produces them: parameters are grouped into buckets (reverse
registration order, ``bucket_cap_mb`` each), and a bucket's all-reduce starts as soon
as its last gradient is accumulated, overlapping the rest of backward (from the second
backward on: the first reduces every bucket at its end, learning which buckets get
gradients in parts, see ``Bucket.held``). The end of backward waits for every bucket.
For a DTensor parameter the reduction acts on this rank's local shard: DP ranks at the
same tensor-parallel coordinate hold the same shard. ``no_sync()`` accumulates locally (gradient accumulation).

With ``shard_gradients()`` (ZeRO-2 and 3, called by DistributedOptimizer) buckets are
reduce-scattered instead, one per unit as FSDP groups them (each ``nn.ModuleList``
member, then the rest; ``vescale.parallel.zero3``): each rank keeps only its slice of
every gradient, and each whole gradient is copied into its bucket and dropped as soon
as backward has produced it, so whole gradients never pile up.

``broadcast_buffers=True`` (the default, as torch's DDP) broadcasts DP rank 0's buffers
(BatchNorm's running statistics) before each forward that follows a reducing backward,
in one collective; a model without buffers sends nothing.

This file holds the module wrapper; two others hold the rest, as mixins of DDP (their
methods share its state): ddp_buckets.py, which parameters share a bucket and where each
gradient sits in it; ddp_reduction.py, backward's collectives: when each bucket is
launched (in an order every rank agrees on), parameters without a gradient,
tensor-parallel Partial sums, and where the average divides (fp16, ``as_shares``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from .. import _trace
from ..device_mesh import DeviceMesh
from .._local import local_of  # noqa: F401  (re-exported: vescale.parallel.ddp.local_of)
from ..deferred import has_deferred, is_deferred, materialize_module
from .ddp_buckets import Bucket, Slot, _BucketLayout  # noqa: F401  (Slot re-exported: vescale.parallel.ddp.Slot)
from .ddp_reduction import _GradientReduction
from .tp_grads import partial_gradients_of

__all__ = ["DDP"]


class DDP(_BucketLayout, _GradientReduction, nn.Module):
    def __init__(self, module: nn.Module, data_parallel: DeviceMesh | dist.ProcessGroup, *,
                 bucket_cap_mb: float = 25.0, reduce_scatter: bool = False, broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        # torch's require_forward_param_sync: buffers are broadcast before a forward that
        # follows one whose backward reduces (or the first), as torch's DDP does
        self._buffers_due = True
        if isinstance(data_parallel, DeviceMesh):
            if data_parallel.ndim != 1:
                raise ValueError(f"DDP takes a 1-d data-parallel mesh (e.g. mesh['DP']), got {data_parallel}")
            self.group = data_parallel.get_group(0)
        else:
            self.group = data_parallel
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.reduce_scatter = reduce_scatter
        self._cap_mb = bucket_cap_mb
        self._sync = True
        self._callback_queued = False
        self._user_task = -1  # the graph task of the backward running: where _finish was queued
        self._arrived: set[int] = set()  # ids of the parameters whose gradient arrived this backward
        self._late: list[nn.Parameter] = []  # arrived after their bucket was launched (see _finish)
        self._holds_learned = False  # the first backward learns the held buckets (Bucket.held)
        self._next_bucket = 0  # buckets launch in order: the first not launched yet this step
        # ZeRO-3: per unit module (id), its buckets that launch when backward reaches the
        # unit before it; and those due at the next such point (see _unit_backward_started)
        self._unit_buckets: dict[int, list[Bucket]] = {}
        self._window: list[Bucket] = []
        self._sharded = None
        self._shares = False  # this backward's gradients are shares of the average (mark_shares)
        self.sharded_parameters = None  # ZeRO-3's, set by DistributedOptimizer (see the property)
        self.buckets = self._make_buckets(bucket_cap_mb, by_unit=reduce_scatter)
        from .pipeline.engine import is_pipeline  # (the pipeline imports this module)
        self._reduces_after_schedule = is_pipeline(module)
        if self._reduces_after_schedule:  # it reduces once per step, after its schedule
            # a plain reference, not a submodule: DDP already holds the pipeline as its
            # `module`, and a cycle in the module tree sends tree walkers (torch's
            # ModTracker, comm_trace) into endless recursion
            object.__setattr__(module, "_data_parallel", self)
        # deferred tensors get the same values on every rank when materialised: no broadcast,
        # and ZeRO-3 (DistributedOptimizer) materialises only each rank's slices
        self._deferred = has_deferred(module)
        self._index_slots()
        # tensor-parallel Partial gradients: reduced here, with the DP ones
        self._partial_params = set()
        for reducer in partial_gradients_of(module):
            reducer.driver = self
            self._partial_params.update(id(p) for p in reducer.params)
        self._broadcast_parameters()
        # frozen now: no slot, no hook, no ZeRO slice (see refuse_thawed)
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        for b in self.buckets:
            for s in b.slots:
                s.param.register_post_accumulate_grad_hook(self._grad_ready)
        # ZeRO-2: per parameter, this rank's slice of the averaged gradient.
        self.grad_shards: dict[int, torch.Tensor] = {}

    @property
    def sharded_parameters(self):
        """ZeRO-3's ShardedParameters (DistributedOptimizer sets it): DDP then launches its
        reduce-scatters at the points of backward that ZeRO-3 reports (``_agreed_point``)."""
        return self._sharded

    @sharded_parameters.setter
    def sharded_parameters(self, value) -> None:
        self._sharded = value
        if value is not None and self not in value._listeners:
            value._listeners.append(self)

    @property
    def deferred(self) -> bool:
        """Whether the model still holds vescale.deferred_init tensors (no values yet)."""
        return self._deferred

    def materialize(self) -> None:
        """Gives the model's deferred tensors their values (whole, on every rank); a no-op
        once done. DDP does it at the first forward; DistributedOptimizer at ZeRO-1/2's
        start and, for the buffers, after ZeRO-3 has materialised its slices."""
        if self._deferred:
            materialize_module(self.module)
            self._deferred = False

    def forward(self, *args, **kwargs):
        refuse_thawed(self.thawed())
        self.materialize()  # a vescale.deferred_init model: values are needed now
        if self.broadcast_buffers and self._buffers_due:
            self._broadcast_buffers()
        self._buffers_due = torch.is_grad_enabled() and self._sync
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and not self._reduces_after_schedule:
            self._hook_outputs(out)
        return out

    def _hook_outputs(self, out) -> None:
        """Backward reaching an output (before any gradient of the model's, in the graph
        task the user's ``backward`` started) queues the end of this DDP's backward there.
        Queued by the first gradient instead, it would go to the graph task running then:
        under torch's reentrant checkpointing that is the recomputed block's own backward,
        which ends before the rest of the model's gradients come, on those ranks only whose
        first gradient is the block's (a data-dependent branch before it decides: set-up
        fuzzer, seed 157386), and the ranks issued different collectives."""
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._output_reached)

    def _output_reached(self, grad):
        # (each output backward reaches calls it: the first that begins is enough)
        if self._sync and not self._callback_queued and self._gives_gradients():
            self._begin_backward()

    def _gives_gradients(self) -> bool:
        """Whether the backward running accumulates into some parameter of this rank's
        (it reaches its AccumulateGrad node): not so for ``torch.autograd.grad`` through
        the model (a gradient penalty), which reduces nothing then, as torch's DDP."""
        return any(s.param.requires_grad and torch._C._will_engine_execute_node(get_gradient_edge(s.param).node)
                   for b in self.buckets for s in b.slots)  # (frozen between steps: no gradient edge)

    def thawed(self) -> list[str]:
        """Names of the parameters frozen when this DDP was built that require grad now:
        they have no slot, no hook and no ZeRO slice (see ``refuse_thawed``)."""
        return [n for n, p in self._frozen if p.requires_grad]

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False makes backward accumulate without reducing (as in
        ``no_sync``); the next backward with it True reduces everything."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``nn.Module.zero_grad``, and ZeRO-2/3's reduced gradient slices too: they
        live here, not in ``.grad``, and each backward adds to them as ``.grad`` adds."""
        super().zero_grad(set_to_none)
        self.grad_shards.clear()

    def shard_gradients(self) -> None:
        """ZeRO-2/3 (DistributedOptimizer calls it before reading the slots): gradients are
        reduce-scattered from now on, in one bucket per unit (capped at ``bucket_cap_mb``)
        instead of size-capped buckets: a unit's gradients are copied into their bucket
        as they arrive, so the transient whole gradients are one unit's, as in FSDP."""
        self.reduce_scatter = True
        self.buckets = self._make_buckets(self._cap_mb, by_unit=True)
        self._holds_learned = False  # (new buckets: learned again)
        self._index_slots()

    def sync_gradients(self) -> None:
        """Reduces every gradient now: after backward passes run under ``no_sync``
        (gradient accumulation, or a pipeline schedule's micro-batches)."""
        self._finish()

    # ---- set-up ----

    def _broadcast_parameters(self) -> None:
        """Start from the same values on every DP rank (rank 0's)."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                if not is_deferred(t):
                    _trace.call("broadcast", self.group, local_of(t), dist.broadcast, local_of(t), src=src,
                                group=self.group, source="ddp")

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """DP rank 0's buffers on every DP rank (``broadcast_buffers``, as torch's DDP), so
        that BatchNorm's running statistics stay the same everywhere: one broadcast of
        all their bytes (none for a model without buffers)."""
        buffers = [t for t in (local_of(b) for b in self.module.buffers()) if not t.is_meta]
        if self.world == 1 or not buffers:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in buffers:
            by_device.setdefault(t.device, []).append(t)
        src = dist.get_global_rank(self.group, 0)
        for tensors in by_device.values():
            # widest elements first: every piece of the byte buffer then starts at a
            # multiple of its own element size, so it views back as its dtype in place
            tensors.sort(key=lambda t: -t.element_size())
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
            _trace.call("broadcast", self.group, flat, dist.broadcast, flat, src=src, group=self.group,
                        source="ddp")
            if self.rank != 0:
                offset = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    t.copy_(flat[offset:offset + n].view(t.dtype).view(t.shape))
                    offset += n


class _Shares(torch.autograd.Function):
    """The identity whose backward divides the gradient by the DP size and marks the
    DDPs' backward as summing shares (``DDP.mark_shares``)."""

    @staticmethod
    def forward(ctx, loss, ddps):
        ctx.ddps = ddps
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, g):
        for ddp in ctx.ddps:
            ddp.mark_shares()
        return g / ctx.ddps[0].world, None


def as_shares(loss: torch.Tensor, ddps: list[DDP]) -> torch.Tensor:
    """``loss`` whose backward starts from this rank's share of the DP average: its
    gradient is divided by the DP size at the root of the graph, and the DDPs sum. Each
    rank's backward then holds one device's values for its samples, where the gradient of
    a local mean is DP times larger and overflows fp16 where one device's does not
    (set-up fuzzer, seed 14332). Scale the result, not ``loss``: the scale then multiplies
    the gradient first, in the loss's dtype, and overflows exactly where one device's
    does (fp16 ends at 65,504: 2^16 is inf). DDPs over different DP sizes average as
    before (one loss cannot be a share of two averages)."""
    ddps = [d for d in ddps if d.world > 1]
    if not ddps or not loss.requires_grad or len({d.world for d in ddps}) != 1:
        return loss
    return _Shares.apply(loss, ddps)


def refuse_thawed(names: list[str]) -> None:
    """Raises where parameters frozen when the model was made data parallel require grad
    now: their gradients would stay each rank's own (never averaged, as under torch's DDP)
    and a ZeRO optimizer has no slice of them to step: they would train apart from one
    device's. ``names``: this rank's such parameters (a pipeline's other stages may have some)."""
    if names:
        raise RuntimeError(
            f"parameters frozen (requires_grad=False) when the model was made data parallel require grad now "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): their gradients would not be averaged "
            f"over the DP ranks, nor stepped under ZeRO. Set requires_grad before vescale.parallelize / DDP (to "
            f"hold a parameter still for a while, give its param group lr=0), or parallelize the model again "
            f"after unfreezing")
