"""DDP's buckets: which parameters' gradients travel in one collective, and where each
gradient sits in it.

Parameters are grouped in reverse registration order (gradients arrive roughly in that
order), by dtype and device, ``bucket_cap_mb`` each; after ``shard_gradients()``
(ZeRO-2 and 3) one bucket per unit as FSDP groups them (each ``nn.ModuleList`` member,
then the rest; ``vescale.parallel.zero3``). The ranks' buckets pair up in collectives, so
every rank must cut the same ones: the cut is made from what every rank has alike
(``_even_share_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .. import _C
from .._local import local_of
from ..deferred import is_deferred


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
    # launched at the end of backward only: a parameter of it got its gradient in parts
    # (more than once in one backward: reentrant checkpointing recomputes in backwards of
    # its own), so its count of arrivals says nothing of when it is whole (_learn_holds)
    held: bool = False
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


class _BucketLayout:
    """DDP's bucket set-up, a mixin of DDP: it reads ``self.module`` and ``self.world``,
    and sets what backward (ddp_reduction.py) looks the buckets up by."""

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
