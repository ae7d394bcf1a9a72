"""DDP: data parallelism over one mesh dim, for plain and tensor-parallel DTensor models.

    model = DDP(parallelize_module(model, mesh["TP"], plan), mesh["DP"])

Each data-parallel rank runs its own micro-batch; gradients are averaged over the DP
group as backward produces them: parameters are grouped into buckets (reverse
registration order, ``bucket_cap_mb`` each), and a bucket's all-reduce starts as soon
as its last gradient is accumulated, overlapping the rest of backward. The end of
backward waits for every bucket. For a DTensor parameter the reduction acts on this
rank's local shard: DP ranks at the same tensor-parallel coordinate hold the same
shard. ``no_sync()`` accumulates locally (gradient accumulation).

Buckets are reduced strictly in bucket order, as torch's Reducer does (a bucket whose
gradients are all in waits for the earlier ones): every rank then issues the same
collectives in the same order, whatever order its gradients arrive in. A parameter
unused in this rank's forward (a data-dependent branch) takes part with zeros; after
the reduction it gets the reduced gradient wherever some DP rank had a gradient, and
keeps ``grad None`` only where no rank had one, as torch's DDP with
``find_unused_parameters``. Whether each rank had a gradient travels as one flag per
parameter at the end of its bucket's collective (no collective of its own).

With ``shard_gradients()`` (ZeRO-2 and 3, called by DistributedOptimizer) buckets are
reduce-scattered instead, one per unit as FSDP groups them (each ``nn.ModuleList``
member, then the rest; ``vescale.parallel.zero3``): each rank keeps only its slice of
every gradient, and each whole gradient is copied into its bucket and dropped as soon
as backward has produced it, so whole gradients never pile up.

Under ZeRO-3 the all-gathers share the DP group with the reduce-scatters, so a bucket
is launched at a point every rank agrees on relative to them, not merely when this
rank's gradients happen to be in (a rank whose parameter got no gradient would launch
it later, after all-gathers the other ranks issue after it); the order of launches is
then that agreed one, not strictly bucket order. ZeRO-3 tells DDP when
backward reaches a unit (its pre-backward gather, on every rank in the same order):
before that gather, the buckets of the unit reached before it (whose backward has
ended: it ran after this one in forward) are launched, with zeros where a gradient is
missing; while that unit's backward runs, its buckets launch as soon as their gradients
are in (in bucket order, the same launches). Everything else (the root unit, whose
forward encloses the blocks; a bucket holding a parameter shared by several units,
whose gradient may arrive in a later unit's backward) is launched at the end of
backward, in bucket order.

Tensor-parallel parameters replicated over a TP dim get gradients Partial over it (see
``vescale.parallel.tp_grads``); DDP reduces those too, in the same buckets: when the DP
and TP groups together are the world, by one all-reduce over the world group (the sum
over both at once); otherwise the TP sum follows the DP one, one collective per bucket.
Under ZeRO-2 the TP sum is taken of each rank's slices only, after the reduce-scatter.
Which parameters take these paths is read from their placements, not from their
gradients, so that a DP rank without a gradient chooses the same collectives; a
gradient of such a parameter that arrives replicated is divided by the TP size and
summed the same way.

``broadcast_buffers=True`` (the default, as torch's DDP) broadcasts DP rank 0's buffers
(BatchNorm's running statistics) before each forward that follows a reducing backward,
in one collective; a model without buffers sends nothing.

In fp16 the average divides before it sums, as torch's DDP does (an fp16 sum of
loss-scaled gradients can overflow where their average does not); in wider types it
divides the (smaller) result. A backward whose loss gradient was divided by the DP size
at the root already (``as_shares``, with loss scaling: a rank's loss-scaled fp16
gradients then stay as small as one device's) is summed only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C, _trace
from ..device_mesh import DeviceMesh
from .._local import local_of  # noqa: F401  (re-exported: vescale.parallel.ddp.local_of)
from ..deferred import has_deferred, is_deferred, materialize_module
from ..dtensor import DTensor
from ..placement_types import Partial, to_c
from .tp_grads import copy_back, land, launch_partial_sums, partial_dims, partial_gradients_of, sum_over_dims

__all__ = ["DDP"]


@dataclass(eq=False)
class Slot:
    """Where one parameter's local gradient sits in its bucket: flat, padded to a
    multiple of the DP size, laid out rank-major so a reduce-scatter hands every rank
    its own slice of each gradient."""
    param: nn.Parameter
    numel: int
    chunk: int   # elements per rank
    offset: int  # in each rank's row of the bucket
    index: int   # in its bucket's slots (and flags: see Bucket.missing)


@dataclass
class Bucket:
    dtype: torch.dtype
    device: torch.device
    slots: list[Slot] = field(default_factory=list)
    chunk_total: int = 0  # elements per rank
    buffer: torch.Tensor | None = None
    pending: int = 0
    work: object = None  # (handle, result) once launched; reduce-scatter: handle None once waited for
    in_buffer: list[Slot] = field(default_factory=list)  # the slots the DP collective carries
    tp: list = field(default_factory=list)  # Partial (TP) sums in flight (tp_grads.launch_partial_sums)
    partial: list = field(default_factory=list)  # ZeRO-2: (slot, its gradient's Partial TP dims)
    staged: set = field(default_factory=set)  # ZeRO-2: ids of the slots copied into `buffer` already
    # all-reduce: the buffer kept from step to step (as torch's DDP keeps its buckets): a
    # fresh one each step costs its page faults, several times the copy into it. Sized
    # world x chunk_total, it also takes ZeRO-1's gather of the updated parameters.
    kept: torch.Tensor | None = None
    cap_bytes: int = 0  # what counts against bucket_cap_mb (_even_share_bytes)
    unit: int = -1  # by-unit buckets: the index of the unit in _units(module)
    shared: bool = False  # holds a parameter of several units (its gradient may come later)
    # indices of the slots without a gradient on this rank this step: they took part with
    # zeros, and keep the result only where another DP rank had a gradient (the flags:
    # one element per slot after the gradients in the collective, 1 where a rank had one)
    missing: list[int] = field(default_factory=list)

    def numel(self) -> int:
        return self.chunk_total


def _even_share_bytes(p: nn.Parameter) -> int:
    """A parameter's bytes per rank as if its shards were even: the same on every rank.
    Buckets are cut by it, so that ranks whose uneven tensor-parallel shards differ in
    size (or are empty) still put the same parameters in each bucket: a bucket's
    tensor-parallel sums run across those ranks, and with other cuts they disagreed
    about the sizes (gloo aborted; found by the set-up fuzzer)."""
    local = local_of(p)
    splits = 1
    if _C.is_dtensor(p):
        for m, placement in enumerate(p.placements):
            if placement.splits():
                splits *= p.device_mesh.size(m)
    return -(-p.numel() // splits) * local.element_size()


class DDP(nn.Module):
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
        if is_pipeline(module):  # it reduces once per step, after its schedule
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
        self.materialize()  # a vescale.deferred_init model: values are needed now
        if self.broadcast_buffers and self._buffers_due:
            self._broadcast_buffers()
        self._buffers_due = torch.is_grad_enabled() and self._sync
        return self.module(*args, **kwargs)

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

    def shard_gradients(self) -> None:
        """ZeRO-2/3 (DistributedOptimizer calls it before reading the slots): gradients are
        reduce-scattered from now on, in one bucket per unit (capped at ``bucket_cap_mb``)
        instead of size-capped buckets: a unit's gradients are copied into their bucket
        as they arrive, so the transient whole gradients are one unit's, as in FSDP."""
        self.reduce_scatter = True
        self.buckets = self._make_buckets(self._cap_mb, by_unit=True)
        self._index_slots()

    def sync_gradients(self) -> None:
        """Reduces every gradient now: after backward passes run under ``no_sync``
        (gradient accumulation, or a pipeline schedule's micro-batches)."""
        self._finish()

    # ---- set-up ----

    def _make_buckets(self, cap_mb: float, by_unit: bool = False) -> list[Bucket]:
        params, seen = [], set()
        for p in self.module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        unit_of: dict[int, int] = {}
        shared: set[int] = set()
        units: list[nn.Module] = []
        if by_unit:
            from .zero3 import _units  # (zero3 imports this module)
            units = _units(self.module)
            holders: dict[int, list[nn.Module]] = {}
            for i, unit in enumerate(units):
                for p in unit.parameters():
                    unit_of.setdefault(id(p), i)
                    if unit is not units[-1]:  # (the root holds every parameter)
                        holders.setdefault(id(p), []).append(unit)
            for pid, held_by in holders.items():  # in two units neither of which holds the other
                outer = [u for u in held_by if not any(v is not u and any(m is u for m in v.modules())
                                                       for v in held_by)]
                if len(outer) > 1:
                    shared.add(pid)
        buckets: list[Bucket] = []
        open_buckets: dict[tuple, Bucket] = {}
        cap = int(cap_mb * 2**20)
        for p in reversed(params):  # gradients arrive roughly in reverse order
            local = local_of(p)
            # a deferred parameter is on meta until materialised, on the CPU: a bucket on
            # meta would run its collectives on nothing, and no error would say so
            device = torch.device("cpu") if is_deferred(local) else local.device
            key = (local.dtype, device, unit_of.get(id(p)))
            b = open_buckets.get(key)
            if b is None or b.cap_bytes >= cap:
                b = Bucket(local.dtype, device, unit=unit_of.get(id(p), -1))
                buckets.append(b)
                open_buckets[key] = b
            b.shared = b.shared or id(p) in shared
            b.cap_bytes += _even_share_bytes(p)
            # (at least one element: a tensor-parallel split may leave this rank an empty
            # shard, which then takes a padding element per DP rank)
            chunk = max(1, -(-local.numel() // self.world))
            b.slots.append(Slot(p, local.numel(), chunk, b.chunk_total, len(b.slots)))
            b.chunk_total += chunk
        self._unit_buckets = {}
        for b in buckets:  # (in bucket order)
            if b.unit >= 0 and not b.shared and b.unit != len(units) - 1:
                self._unit_buckets.setdefault(id(units[b.unit]), []).append(b)
        self._window = []
        return buckets

    def _index_slots(self) -> None:
        self._slot_of = {id(s.param): (b, s) for b in self.buckets for s in b.slots}

    def bucket_of(self, param: nn.Parameter) -> Bucket | None:
        """The bucket that reduces ``param``'s gradient; None for a parameter not of this model."""
        found = self._slot_of.get(id(param))
        return found[0] if found else None

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

    # ---- backward ----

    def mark_shares(self) -> None:
        """The gradients of the backward now running are each rank's share of the average
        already (the loss's gradient was divided by the DP size at the root of the graph):
        they are summed, not averaged. Read by every launch of this backward, reset when
        it ends."""
        self._shares = True

    def _divisor(self) -> int:
        return 1 if self._shares else self.world

    def _average(self, b: Bucket, t: torch.Tensor, *, before_sum: bool) -> None:
        """The average's division of bucket ``b``'s ``t``, at the point it belongs: before
        the sum in fp16, whose range a sum of DP ranks' loss-scaled gradients can overflow
        where their average does not (as torch's DDP divides first; set-up fuzzer seed
        13083); otherwise after it, on the collective's result, which a reduce-scatter
        makes DP times smaller. Shares are summed only."""
        if (b.dtype == torch.float16) == before_sum and self._divisor() != 1:
            t.div_(self._divisor())

    def _begin_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            for b in self.buckets:
                b.pending = len(b.slots)

    def _agreed_launches(self) -> bool:
        """ZeRO-3's reduce-scatters of this backward launch at points ZeRO-3 reports."""
        return self._sync and self.reduce_scatter and self._sharded is not None

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        self._begin_backward()
        bucket, slot = self._slot_of[id(param)]
        if self._agreed_launches() and bucket.work is not None:
            raise RuntimeError(
                f"ZeRO-3: a gradient of a parameter of shape {tuple(param.shape)} arrived after its unit's "
                "reduce-scatter was launched (its unit's backward had ended on every rank): a parameter used "
                "by the forward of a unit that runs before its own unit (the first ModuleList member, or "
                "the root, that holds it) must be held by that unit, or by the root")
        if self.reduce_scatter:
            self._stage(bucket, slot)
        bucket.pending -= 1
        if self._agreed_launches():
            # the buckets of the unit whose backward runs, as their gradients are all in
            # (in bucket order): the next agreed point launches them anyway
            while self._window and self._window[0].pending == 0:
                self._launch(self._window.pop(0))
            return
        # In bucket order only, as torch's Reducer: launched as they fill up, a parameter
        # unused on one rank delays its bucket there only, and same-sized buckets of two
        # ranks would pair up in one collective (mixed gradients, silently).
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._next_bucket += 1
            self._launch(self.buckets[self._next_bucket - 1])

    def _agreed_point(self) -> None:
        """ZeRO-3: backward reached a unit, whose all-gather comes next, on every rank at
        this point: the buckets due (those of the unit reached before, whose backward has
        ended) are launched first, in bucket order, zeros where a gradient is missing."""
        if not self._agreed_launches():
            return
        due = [b for b in self._window if b.work is None]
        self._window = []
        if due:
            self._begin_backward()
            for b in due:
                self._launch(b)

    def _unit_backward_started(self, unit: nn.Module) -> None:
        """ZeRO-3: every backward use of ``unit`` (no enclosing unit: not a root) has begun:
        its buckets are due at the next agreed point, or earlier once their gradients are
        all in (``_grad_ready``)."""
        if self._agreed_launches():
            due = [b for b in self._unit_buckets.get(id(unit), []) if b.work is None]
            if due:
                self._begin_backward()  # (_finish launches them, also where no gradient arrives here)
                self._window += due

    def _launch(self, b: Bucket) -> None:
        if self.reduce_scatter:
            self._launch_reduce_scatter(b)
            return
        # a parameter without a gradient here (unused in this rank's forward) takes part
        # with zeros: every DP rank sends the same collectives, whatever its data
        b.missing = [s.index for s in b.slots if s.param.grad is None]
        for i in b.missing:
            b.slots[i].param.grad = self._zero_grad(b.slots[i].param)
        for s in b.slots:
            self._make_partial(s.param, s.param.grad)
        # all-reduce: gradients back to back, no padding; Partial (TP) gradients summed
        # over DP x TP at once where one group (the world) holds both
        over_world = [self._sums_over_world(s.param) for s in b.slots]
        b.tp = launch_partial_sums([s.param for s, w in zip(b.slots, over_world) if w],
                                   over_world=True, divide_by=self._divisor())
        b.in_buffer = [s for s, w in zip(b.slots, over_world) if not w]
        flags = torch.ones(len(b.slots), dtype=b.dtype, device=b.device)
        if b.missing:
            flags[b.missing] = 0
        if self.world == 1:  # one DP rank: its gradients are their average; only TP sums remain
            b.tp += launch_partial_sums([s.param for s in b.in_buffer if self._partial_dims(s.param)])
            b.in_buffer = []
            b.work = (None, flags)
            return
        flat = [local_of(s.param.grad).reshape(-1) for s in b.in_buffer] + [flags]
        total = sum(s.numel for s in b.in_buffer) + len(b.slots)
        if b.kept is None or b.kept.numel() < total:
            # with room for every rank's padded slices: ZeRO-1 gathers the updated
            # parameters into this buffer after the step (DistributedOptimizer)
            b.kept = torch.empty(max(total, self.world * b.chunk_total), dtype=b.dtype, device=b.device)
        b.buffer = b.kept[:total]
        torch.cat(flat, out=b.buffer)
        self._average(b, b.buffer, before_sum=True)
        token = _trace.collective_started("all_reduce", self.group, b.buffer, source="ddp")
        b.work = (_trace.traced(dist.all_reduce(b.buffer, group=self.group, async_op=True), token), b.buffer)

    def _partial_dims(self, p: nn.Parameter) -> tuple[int, ...]:
        """The TP mesh dims over which ``p``'s gradient is summed here: every dim (of more
        than one rank) that ``p`` is replicated over, for a parameter whose Partial
        gradients DDP reduces (tp_grads). Read from the parameter, not from its gradient:
        every DP rank must choose the same collectives, also one that got no gradient
        (``_make_partial`` makes a gradient that came replicated Partial)."""
        if id(p) not in self._partial_params:
            return ()
        return tuple(d for d, pl in enumerate(p.placements) if pl.is_replicate() and p.device_mesh.size(d) > 1)

    def _sums_over_world(self, p: nn.Parameter) -> bool:
        dims = self._partial_dims(p)
        mesh = p.device_mesh if dims else None
        return bool(dims) and len(dims) == sum(n > 1 for n in mesh.shape) \
            and self.world * mesh.size() == dist.get_world_size()

    def _make_partial(self, p: nn.Parameter, grad: torch.Tensor | None) -> None:
        """Labels ``grad`` (``p``'s) Partial over all of ``_partial_dims(p)``: a gradient
        replicated over such a dim (as some backward formulas give it) is divided by the
        dim's size there, so that the sum over it is the gradient again."""
        dims = self._partial_dims(p)
        if grad is None or not dims:
            return
        have = partial_dims(grad)
        n = 1
        for d in dims:
            if d not in have:
                n *= p.device_mesh.size(d)
        if n > 1:
            local_of(grad).div_(n)
            _C.relabel(grad, to_c(self._partial_placements(p)))

    def _partial_placements(self, p: nn.Parameter) -> list:
        dims = self._partial_dims(p)
        return [Partial("sum") if d in dims else pl for d, pl in enumerate(p.placements)]

    def _zero_grad(self, p: nn.Parameter) -> torch.Tensor:
        """Zeros in the form of ``p``'s gradient (Partial over ``_partial_dims``)."""
        zeros = torch.zeros_like(local_of(p))
        if not _C.is_dtensor(p):
            return zeros
        return DTensor.from_local(zeros, p.device_mesh, self._partial_placements(p), shape=p.shape,
                                  stride=p.stride())

    def _stage(self, b: Bucket, s: Slot) -> None:
        """Copies a gradient into its bucket's buffer, rank-major and padded so that a
        reduce-scatter hands each rank its own slice of every gradient, and drops it.
        The buffer's last columns are the flags (one per slot, see Bucket.missing)."""
        if b.buffer is None:
            b.buffer = torch.empty(self.world, b.chunk_total + len(b.slots), dtype=b.dtype, device=b.device)
        rows = b.buffer[:, s.offset:s.offset + s.chunk]
        b.staged.add(id(s))
        if dims := self._partial_dims(s.param):  # also without a gradient here: see _partial_dims
            b.partial.append((s, dims))
        if s.param.grad is None:  # unused on this rank this step: contributes zeros
            rows.zero_()
            b.missing.append(s.index)
            return
        self._make_partial(s.param, s.param.grad)
        flat = local_of(s.param.grad).reshape(-1)
        full = s.numel // s.chunk
        rows[:full].copy_(flat[: full * s.chunk].view(full, s.chunk))
        if full < self.world:  # the rest of the gradient, then padding
            rows[full:].zero_()
            rows[full, : s.numel - full * s.chunk].copy_(flat[full * s.chunk:])
        s.param.grad = None  # only this rank's slice is kept

    def _launch_reduce_scatter(self, b: Bucket) -> None:
        for s in b.slots:  # what backward did not hand over (no_sync steps, unused parameters)
            if id(s) not in b.staged:
                self._stage(b, s)
        b.in_buffer, b.staged = b.slots, set()
        flags = b.buffer[:, b.chunk_total:]
        flags.fill_(1)
        if b.missing:
            flags[:, b.missing] = 0
        # earlier units' reduce-scatters: waited for and their handles dropped, one left in
        # flight (overlapping this unit's backward). Gloo's handle holds a whole copy of its
        # input until the handle itself is freed, so kept handles would add up to the model.
        for earlier in self.buckets:
            if earlier is not b and earlier.work is not None and earlier.work[0] is not None:
                earlier.work[0].wait()
                earlier.work = (None, earlier.work[1])
        self._average(b, b.buffer, before_sum=True)
        out = torch.empty(b.chunk_total + len(b.slots), dtype=b.dtype, device=b.device)
        token = _trace.collective_started("reduce_scatter", self.group, b.buffer, source="zero")
        b.work = (_trace.traced(_reduce_scatter(out, b.buffer.view(-1), self.group), token), out)
        # the input is the collective's now (gloo copies it at the launch; c10d's other
        # backends keep it referenced until done): ours would be one more unit's gradients
        b.buffer = None

    def _finish(self) -> None:
        self._callback_queued = False
        # the buckets of the unit whose backward ran last first (some ranks launched part of
        # them already), then the rest in bucket order: every rank launched the same before
        window, self._window = self._window, []
        for b in [b for b in window if b.work is None] + [b for b in self.buckets if b.work is None]:
            if b.work is None:
                self._launch(b)
        self._next_bucket = 0
        partial = []  # ZeRO-2: Partial (TP) slices, summed after every bucket's reduce-scatter
        unused = []  # slots that no DP rank had a gradient for
        for b in self.buckets:
            work, result = b.work
            if work is not None:  # (None: a reduce-scatter waited for already)
                work.wait()
            self._average(b, result, before_sum=False)
            offset = 0
            for s in b.in_buffer:
                if self.reduce_scatter:  # a view: the bucket's slice buffer lives until zero_grad
                    self.grad_shards[id(s.param)] = result[s.offset:s.offset + s.chunk]
                else:
                    grad = local_of(s.param.grad)
                    grad.copy_(result[offset:offset + s.numel].view_as(grad))
                offset += s.numel
            if b.missing:  # (the flags are read only here: no wait for the device otherwise)
                had = (result[-len(b.slots):] > 0).tolist()
                unused += [b.slots[i] for i in b.missing if not had[i]]
            if self.reduce_scatter:
                partial += b.partial
            else:  # the TP sums: those over the world, and those that follow the DP sum
                b.tp += launch_partial_sums([s.param for s in b.in_buffer if self._partial_dims(s.param)])
                land(b.tp)
            b.work, b.buffer, b.in_buffer, b.partial, b.missing = None, None, [], [], []
        if partial:
            self._sum_partial_slices(partial)
        for s in unused:  # unused on every DP rank: no gradient, as torch's DDP leaves it
            s.param.grad = None
            self.grad_shards.pop(id(s.param), None)
        self._shares = False  # after every launch above: the next backward says again

    def _sum_partial_slices(self, partial: list[tuple[Slot, tuple[int, ...]]]) -> None:
        """ZeRO-2: this rank's slices of Partial (TP) gradients, summed over their TP
        dims, one collective per mesh and set of dims for the whole step. Every TP rank at this DP coordinate
        holds the same slice of a replicated parameter's gradient."""
        groups: dict[tuple, list[Slot]] = {}
        for s, dims in partial:
            groups.setdefault((_C.mesh_of(s.param), dims), []).append(s)
        for (_, dims), slots in groups.items():
            shards = [self.grad_shards[id(s.param)] for s in slots]
            buffer = torch.cat(shards)
            sum_over_dims(buffer, slots[0].param.device_mesh, dims)
            copy_back(buffer, shards)


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


def _reduce_scatter(out: torch.Tensor, whole: torch.Tensor, group):
    # torch 2.13 renames reduce_scatter_tensor to reduce_scatter_single; 2.11 has only the former.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, whole, group=group, async_op=True)
