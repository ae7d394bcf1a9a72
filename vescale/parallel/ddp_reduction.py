"""DDP's backward: each bucket's collective, launched in an order every rank agrees on,
and its result put back as the parameters' gradients (or, under ZeRO-2/3, this rank's
slices of them).

The end of backward (``_finish``: every bucket launched and waited for) is queued in
the graph task of the user's ``backward``, when backward reaches the model's output
(DDP.forward hooks it), not from a gradient's hook: under torch's reentrant
checkpointing a gradient can come from a nested backward of its own, whose end is not
the user's.

Buckets are reduced strictly in bucket order, as torch's Reducer does (a bucket whose
gradients are all in waits for the earlier ones): every rank then issues the same
collectives in the same order, whatever order its gradients arrive in. A parameter
unused in this rank's forward (a data-dependent branch) takes part with zeros; after
the reduction it gets the reduced gradient wherever some DP rank had a gradient, and
keeps ``grad None`` only where no rank had one, as torch's DDP with
``find_unused_parameters``. Whether each rank had a gradient travels as one flag per
parameter at the end of its bucket's collective (no collective of its own).

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

In fp16 the average divides before it sums, as torch's DDP does (an fp16 sum of
loss-scaled gradients can overflow where their average does not); in wider types it
divides the (smaller) result. A backward whose loss gradient was divided by the DP size
at the root already (``as_shares``, with loss scaling: a rank's loss-scaled fp16
gradients then stay as small as one device's) is summed only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C, _trace
from .._local import local_of
from ..dtensor import DTensor
from ..placement_types import Partial, to_c
from .ddp_buckets import Bucket, Slot
from .tp_grads import copy_back, land, launch_partial_sums, partial_dims, sum_over_dims


class _GradientReduction:
    """DDP's backward, a mixin of DDP whose state it shares (the buckets, the DP group,
    whether this backward reduces)."""

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
            self._user_task = torch._C._current_graph_task_id()  # where _finish runs
            for b in self.buckets:
                b.pending = len(b.slots)

    def _launches_early(self, b: Bucket) -> bool:
        """Whether bucket ``b`` may launch before the end of backward, once its gradients
        are all in: not in the first backward (which learns the held buckets), nor a held
        one."""
        return self._holds_learned and not b.held

    def _arrival(self, b: Bucket, param: nn.Parameter) -> bool:
        """Notes ``param``'s gradient arriving; whether it arrived before in this backward.
        In the first backward a bucket whose gradient comes in parts (a second arrival, or
        one in a backward nested in the user's: reentrant checkpointing's, which a
        recomputed block shared with another may run again) is held: launched at the end
        of backward from then on."""
        again = id(param) in self._arrived
        self._arrived.add(id(param))
        if not self._holds_learned and (again or torch._C._current_graph_task_id() != self._user_task):
            b.held = True
        return again

    def _agreed_launches(self) -> bool:
        """ZeRO-3's reduce-scatters of this backward launch at points ZeRO-3 reports."""
        return self._sync and self.reduce_scatter and self._sharded is not None

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        self._begin_backward()
        bucket, slot = self._slot_of[id(param)]
        again = self._arrival(bucket, param)
        if bucket.work is not None:  # reduced already without this part: see _finish
            if self._agreed_launches() and not again:
                raise RuntimeError(
                    f"ZeRO-3: a gradient of a parameter of shape {tuple(param.shape)} arrived after its unit's "
                    "reduce-scatter was launched (its unit's backward had ended on every rank): a parameter used "
                    "by the forward of a unit that runs before its own unit (the first ModuleList member, or "
                    "the root, that holds it) must be held by that unit, or by the root")
            self._late.append(param)
            return
        if self.reduce_scatter:
            self._stage(bucket, slot)
        if not again:
            bucket.pending -= 1
        if self._agreed_launches():
            # the buckets of the unit whose backward runs, as their gradients are all in
            # (in bucket order): the next agreed point launches them anyway
            while self._window and self._window[0].pending == 0 and self._launches_early(self._window[0]):
                self._launch(self._window.pop(0))
            return
        # In bucket order only, as torch's Reducer: launched as they fill up, a parameter
        # unused on one rank delays its bucket there only, and same-sized buckets of two
        # ranks would pair up in one collective (mixed gradients, silently).
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0 \
                and self._launches_early(self.buckets[self._next_bucket]):
            self._next_bucket += 1
            self._launch(self.buckets[self._next_bucket - 1])

    def _agreed_point(self) -> None:
        """ZeRO-3: backward reached a unit, whose all-gather comes next, on every rank at
        this point: the buckets due (those of the unit reached before, whose backward has
        ended) are launched first, in bucket order, zeros where a gradient is missing."""
        if not self._agreed_launches():
            return
        due = [b for b in self._window if b.work is None and self._launches_early(b)]
        self._window = [b for b in self._window if b.work is None and not self._launches_early(b)]
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
        again = id(s) in b.staged  # another part of its gradient (a held bucket's, see _arrival): added
        b.staged.add(id(s))
        if not again and (dims := self._partial_dims(s.param)):  # also without a gradient: see _partial_dims
            b.partial.append((s, dims))
        if s.param.grad is None:  # unused on this rank this step: contributes zeros
            rows.zero_()
            b.missing.append(s.index)
            return
        self._make_partial(s.param, s.param.grad)
        flat = local_of(s.param.grad).reshape(-1)
        put = torch.Tensor.add_ if again else torch.Tensor.copy_
        full = s.numel // s.chunk
        put(rows[:full], flat[: full * s.chunk].view(full, s.chunk))
        if full < self.world:  # the rest of the gradient, then padding
            if not again:
                rows[full:].zero_()
            put(rows[full, : s.numel - full * s.chunk], flat[full * s.chunk:])
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
        # ZeRO-2/3: slices of earlier backwards since zero_grad, which this one's add to
        # (as .grad accumulates); set apart so that the TP sums below see this one's alone
        earlier, self.grad_shards = self.grad_shards, {}
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
        for key, shard in earlier.items():
            if key in self.grad_shards:
                self.grad_shards[key].add_(shard)
            else:
                self.grad_shards[key] = shard
        self._shares = False  # after every launch above: the next backward says again
        self._arrived = set()
        if not self._holds_learned:
            self._learn_holds()
        late, self._late = self._late, []
        for p in late:  # held from now on (under ZeRO-3 too: the parts come alike on every rank
            self._slot_of[id(p)][0].held = True  # unless a branch decides, which this backward raises for)
        if late:
            names = {id(p): n for n, p in self.module.named_parameters()}
            raise RuntimeError(
                f"DDP: a part of the gradient of {', '.join(sorted({names.get(id(p), '?') for p in late}))} arrived "
                "after its bucket was reduced, so this backward's gradient of it lacks that part. It is "
                "accumulated more than once in one backward (torch's reentrant checkpointing, use_reentrant=True, "
                "recomputes a block in a backward of its own), and was not on the first backward, from which DDP "
                "learns what to reduce at the end; it does from now on. Zero the gradients and run the step "
                "again, or use torch.utils.checkpoint with use_reentrant=False")

    def _learn_holds(self) -> None:
        """After the first backward: under ZeRO-3 the held buckets are made the same on
        every DP rank (the union of theirs, one collective in the model's life): its
        reduce-scatters launch at points every rank must agree on. Elsewhere buckets
        launch in bucket order whenever each rank's are ready, so each rank holds its own."""
        self._holds_learned = True
        if self._agreed_launches() and self.world > 1 and self.buckets:
            flags = torch.tensor([float(b.held) for b in self.buckets], device=self.buckets[0].device)
            _trace.call("all_reduce", self.group, flags, dist.all_reduce, flags, op=dist.ReduceOp.MAX,
                        group=self.group, source="ddp")
            for b, held in zip(self.buckets, flags.tolist()):
                b.held = held > 0

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


def _reduce_scatter(out: torch.Tensor, whole: torch.Tensor, group):
    # torch 2.13 renames reduce_scatter_tensor to reduce_scatter_single; 2.11 has only the former.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, whole, group=group, async_op=True)
