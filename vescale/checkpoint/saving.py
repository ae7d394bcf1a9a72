"""vescale.save: what every rank saves, and which rank writes it.

Every rank lists the boxes it holds (the ranks of a pipeline hold different tensors: the
manifest lists all of them); boxes held by several ranks (replicated data, a weight tied
across pipeline stages) are written once, by the holder that has written least so far,
so the writing spreads over the ranks. Rank 0 saves the non-tensor state (scheduler
state, hyperparameters, RNG state, the user's Python values; what only some ranks have,
or each rank a part of, gathered). writing.py puts it on disk; an asynchronous save does
that in a background thread, which the next save, a load, or exit waits for.
"""

from __future__ import annotations

import atexit
import threading
import uuid

import torch
import torch.distributed as dist

from ..boxes import Box
from ..deferred import materialize_before_reading
from .agreement import _agree, _all_gather, _checkpoint_group, _rank_world
from .layout import Layout, build
from .manifest import _RNG_KEY, _dtype_name
from .values import encode
from .writing import _write


class _Pending:
    """The background part of an async save; the next save, a load, or exit waits for it."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"the previous asynchronous vescale.save failed: {error}") from error


_pending = _Pending()
atexit.register(lambda: _pending.thread and _pending.thread.join())


def wait() -> None:
    """Blocks until an asynchronous save has finished (raises if it failed)."""
    _pending.wait()


def _masters_follow_parameters(state: dict) -> None:
    """ZeRO's fp32 masters take what was written into bf16/fp16 parameters since the
    last step (they are saved, and a resume steps from them)."""
    from ..parallel.optimizer import DistributedOptimizer
    for value in state.values():
        inner = getattr(value, "inner", value)  # (ParallelOptimizer)
        if isinstance(inner, DistributedOptimizer):
            inner.refresh_masters()


def save(path: str, state: dict, *, async_save: bool = False) -> None:
    """Saves ``state`` (modules, optimizers, schedulers, tensors, Python values) to the
    directory ``path``. Every rank of the default process group must call it (without
    torch.distributed, the process saves alone). With
    ``async_save`` the local data is snapshotted to host memory and written by a
    background thread; training goes on, and the next save waits for this one.
    Raises TypeError, on every rank and before writing anything, for a value that a
    checkpoint cannot store without pickle (see vescale.checkpoint.values.SUPPORTED)."""
    _pending.wait()  # also what keeps the stale-directory sweep (_remove_stale) off a save in progress
    group = _checkpoint_group()
    rank, world = _rank_world(group)
    materialize_before_reading(state)
    _masters_follow_parameters(state)
    layout = build(state)
    layout.objects[_RNG_KEY] = torch.get_rng_state()
    layout.merge[_RNG_KEY] = _rng_states
    values = _encode_agreed(group, layout.objects)
    holdings = [(item.key, piece.box.to_json(), piece.tensor.numel() * piece.tensor.element_size())
                for item in layout.items.values() for piece in item.pieces]
    meta = {k: dict(shape=list(i.shape), dtype=_dtype_name(i.dtype), saved_from=i.source,
                    optional=i.optional) for k, i in layout.items.items()}
    # the ranks may hold different tensors (pipeline stages): the manifest lists them all
    everyone = _all_gather((holdings, meta, layout.aliases, sorted(layout.objects)), group)
    meta, aliases = _merged_meta(everyone)  # raises the same error on every rank, before anything is written
    mine = _assign_writers([e[0] for e in everyone])[rank]
    chunks = [(item.key, piece.box, piece.tensor) for item in layout.items.values() for piece in item.pieces
              if (item.key, piece.box) in mine]
    tmp = [f"{path}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    if group is not None:
        dist.broadcast_object_list(tmp, src=dist.get_global_rank(group, 0), group=group)
    objects = _gathered_objects(group, layout, [set(e[3]) for e in everyone])
    if objects is not None and objects is not layout.objects:
        values = encode(objects)  # each value passed its own rank's _encode_agreed
    values = values if rank == 0 else None  # rank 0 writes the objects
    if async_save:
        chunks = [(k, b, t.detach().clone()) for k, b, t in chunks]  # the snapshot training may then change
        if values is not None:
            values = (values[0], [t.clone() for t in values[1]])

        def background():
            try:
                _write(path, tmp[0], chunks, meta, values, aliases, group, rank, world)
            except BaseException as e:  # noqa: BLE001  (reported by the next wait)
                _pending.error = e

        _pending.thread = threading.Thread(target=background, name="vescale-async-save", daemon=True)
        _pending.thread.start()
    else:
        _write(path, tmp[0], chunks, meta, values, aliases, group, rank, world)


def _merged_meta(everyone: list) -> tuple[dict, dict]:
    """The manifest's tensors (shape, dtype, ...) and aliases from every rank's: the
    ranks of a pipeline hold different ones. A key that ranks describe differently, or
    that is a tensor on one rank and an alias on another, is an error (on every rank:
    each computes it from the same gathered lists)."""
    meta, aliases, where = {}, {}, {}
    for rank, (_, theirs, their_aliases, _) in enumerate(everyone):
        for k, m in theirs.items():
            if k not in meta:
                meta[k], where[k] = m, rank
            elif (m["shape"], m["dtype"]) != (meta[k]["shape"], meta[k]["dtype"]):
                raise ValueError(f"cannot save '{k}': rank {where[k]} holds it as {meta[k]['dtype']} of shape "
                                 f"{meta[k]['shape']}, rank {rank} as {m['dtype']} of shape {m['shape']}")
        for alias, first in their_aliases.items():
            aliases.setdefault(alias, first)
    for alias, first in aliases.items():
        if alias in meta or first not in meta:
            raise ValueError(f"cannot save '{alias}': the ranks disagree whether it is the same tensor as '{first}' "
                             f"(tied parameters must be tied on every rank that holds them)")
    return meta, aliases


def _gathered_objects(group, layout: Layout, keys: list[set]) -> dict | None:
    """On rank 0, the objects to save: its own, those only other ranks have (a pipeline
    stage's optimizer state), and those the ranks have each a part of, combined
    (``Layout.merge``: optimizer parameter groups). None on the other ranks."""
    rank, world = _rank_world(group)
    if world == 1:
        return layout.objects
    extra = set().union(*keys[1:]) - keys[0]
    send = {k: v for k, v in layout.objects.items() if k in extra or k in layout.merge}
    received = [None] * world if rank == 0 else None
    dist.gather_object(send, received, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    objects = dict(layout.objects)
    for k in sorted(extra):
        objects[k] = next(r[k] for r in received if k in r)
    for k, merge in layout.merge.items():
        objects[k] = merge([r[k] for r in received if k in r])
    return objects


def _encode_agreed(group, objects: dict) -> tuple[dict, list[torch.Tensor]]:
    """values.encode of the objects on every rank (they may differ by rank), agreed: a
    value that one rank cannot store stops every rank's save before anything is written."""
    values, error = None, None
    try:
        values = encode(objects)
    except TypeError as e:
        error = e
    _agree(group, error, "nothing was saved")
    return values


def _assign_writers(everyone: list) -> list[set]:
    """Each distinct (key, box) goes to one of the ranks holding it: the one with the
    fewest bytes assigned so far (ties: lowest rank). Every rank computes the same."""
    holders: dict[tuple, list] = {}
    sizes: dict[tuple, int] = {}
    for rank, holdings in enumerate(everyone):
        for key, box, nbytes in holdings:
            b = (key, Box.from_json(box))
            holders.setdefault(b, []).append(rank)
            sizes[b] = nbytes
    load = [0] * len(everyone)
    mine: list[set] = [set() for _ in everyone]
    for b in sorted(holders, key=lambda b: (-sizes[b], b[0], b[1].offsets)):
        writer = min(holders[b], key=lambda r: (load[r], r))
        load[writer] += sizes[b]
        mine[writer].add(b)
    return mine


def _rng_states(states: list[torch.Tensor]):
    """The CPU generator's state to save, from every rank's (in rank order): one state
    where they are all the same (vescale's random ops draw as one device does, from one
    seed on every rank), else each rank's, for a program that seeds its ranks apart."""
    return states[0] if all(torch.equal(s, states[0]) for s in states[1:]) else list(states)
