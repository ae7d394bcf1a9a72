"""vescale.save / vescale.load: sharded checkpoints that load into any mesh.

    vescale.save("ckpt/step100", {"model": model, "optimizer": opt, "lr_scheduler": sched})
    vescale.load("ckpt/step100", {"model": model, "optimizer": opt, "lr_scheduler": sched})

Saving: every rank lists the boxes it holds; boxes held by several ranks (replicated
data) are written once, by the holder that has written least so far, so the writing
spreads over the ranks. Each rank writes one data file into a temporary directory,
rank 0 writes ``manifest.json`` (per tensor: global shape, dtype, saved boxes with file
offsets and CRC32s, and the placements it was saved from) and ``objects.pt`` (scheduler
state, hyperparameters, RNG state), and the directory is renamed into place only when
everything is on disk: a crash mid-save leaves the previous checkpoint as it was.

Loading: every rank reads the manifest, checks it against its own state (missing or
unexpected keys, shapes, dtypes: all differences in one error, before anything is
changed), then reads, through a memory map, only the byte ranges of saved boxes that
overlap the boxes it holds now, verifying their checksums.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import threading
import uuid

import torch
import torch.distributed as dist

from ..boxes import Box
from .layout import Layout, build
from .storage import Reader, write_file

MANIFEST, OBJECTS = "manifest.json", "objects.pt"
FORMAT = "vescale-checkpoint/1"
_RNG_KEY = "__rng_state__"

__all__ = ["save", "load", "wait"]


# ---- save ------------------------------------------------------------------------------------

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
_group = None  # a process group of its own, so that a background save never mixes with training collectives
atexit.register(lambda: _pending.thread and _pending.thread.join())


def wait() -> None:
    """Blocks until an asynchronous save has finished (raises if it failed)."""
    _pending.wait()


def save(path: str, state: dict, *, async_save: bool = False) -> None:
    """Saves ``state`` (modules, optimizers, schedulers, tensors, Python values) to the
    directory ``path``. Every rank of the default process group must call it. With
    ``async_save`` the local data is snapshotted to host memory and written by a
    background thread; training goes on, and the next save waits for this one."""
    _pending.wait()
    group = _checkpoint_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = build(state)
    layout.objects[_RNG_KEY] = torch.get_rng_state()
    holdings = [(item.key, piece.box.to_json(), piece.tensor.numel() * piece.tensor.element_size())
                for item in layout.items.values() for piece in item.pieces]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, holdings, group=group)
    mine = _assign_writers(everyone)[rank]
    chunks = [(item.key, piece.box, piece.tensor) for item in layout.items.values() for piece in item.pieces
              if (item.key, piece.box) in mine]
    tmp = [f"{path}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(tmp, src=dist.get_global_rank(group, 0), group=group)
    meta = {k: dict(shape=list(i.shape), dtype=str(i.dtype).removeprefix("torch."), saved_from=i.source,
                    optional=i.optional) for k, i in layout.items.items()}
    if async_save:
        chunks = [(k, b, t.detach().clone()) for k, b, t in chunks]  # the snapshot training may then change
        objects = _snapshot(layout.objects) if rank == 0 else None

        def background():
            try:
                _write(path, tmp[0], chunks, meta, objects, layout.aliases, group, rank, world)
            except BaseException as e:  # noqa: BLE001  (reported by the next wait)
                _pending.error = e

        _pending.thread = threading.Thread(target=background, name="vescale-async-save", daemon=True)
        _pending.thread.start()
    else:
        _write(path, tmp[0], chunks, meta, layout.objects if rank == 0 else None, layout.aliases, group, rank,
               world)


def _checkpoint_group():
    global _group
    if _group is None:
        from ..device_mesh import collective_timeout  # torch's default would be 30 minutes

        _group = dist.new_group(backend="gloo", timeout=collective_timeout())
    return _group


def _snapshot(objects: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in objects.items()}


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


def _write(path, tmp, chunks, meta, objects, aliases, group, rank, world) -> None:
    if rank == 0:
        os.makedirs(tmp, exist_ok=False)
    dist.barrier(group=group)
    records = write_file(os.path.join(tmp, f"data_{rank:05d}.bin"), chunks)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, records, group=group)
    if rank == 0:
        tensors = {k: dict(m, chunks=[]) for k, m in meta.items()}
        for recs in gathered:
            for r in recs:
                tensors[r["key"]]["chunks"].append({k: v for k, v in r.items() if k != "key"})
        torch.save(objects, os.path.join(tmp, OBJECTS))
        manifest = dict(format=FORMAT, world_size=world, tensors=tensors, aliases=aliases,
                        files={f"data_{r:05d}.bin": sum(x["nbytes"] for x in recs) for r, recs in enumerate(gathered)})
        _write_json(os.path.join(tmp, MANIFEST), manifest)
        _replace(tmp, path)
    dist.barrier(group=group)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def _replace(tmp: str, path: str) -> None:
    """tmp becomes path; an existing checkpoint at path stays loadable until the last
    moment, and as path.old if we crash between the two renames."""
    old = f"{path}.old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------

def load(path: str, state: dict, *, strict: bool = True, rng: bool = True) -> None:
    """Loads a checkpoint written by vescale.save into ``state`` in place, whatever mesh,
    placements, world size or ZeRO stage it was saved from. Raises ValueError, before
    changing anything, when keys, shapes or dtypes do not match (``strict=False``
    ignores keys only one side has)."""
    _pending.wait()
    root = _resolve(path)
    with open(os.path.join(root, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{root} is not a vescale checkpoint (format {manifest.get('format')!r})")
    saved = manifest["tensors"]
    for alias, first in manifest.get("aliases", {}).items():
        saved.setdefault(alias, saved[first])
    layout = build(state, {k: (tuple(v["shape"]), _dtype(v["dtype"])) for k, v in saved.items()})
    objects = torch.load(os.path.join(root, OBJECTS), weights_only=False)
    _check(layout, saved, objects, strict, root)
    reader = Reader(root, manifest["files"])
    _bind_deferred(layout, saved, reader)
    copies = _plan_reads(layout, saved)
    for key, chunk, dtype, overlap, _ in copies:  # every checksum first: a corrupt file changes nothing
        reader.verify(key, chunk, dtype, overlap)
    with torch.no_grad():
        for key, chunk, dtype, overlap, dest in copies:
            dest.copy_(reader.view(chunk, dtype, overlap))
        _masters_from_parameters(state, layout, saved)
    for key, restore in layout.restore.items():
        if key in objects:
            restore(objects[key])
    if rng and _RNG_KEY in objects:
        torch.set_rng_state(objects[_RNG_KEY])


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    if os.path.exists(os.path.join(f"{path}.old", MANIFEST)):
        return f"{path}.old"  # a save crashed between its two renames
    raise FileNotFoundError(f"no vescale checkpoint at {path} (no {MANIFEST})")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _check(layout: Layout, saved: dict, objects: dict, strict: bool, root: str) -> None:
    problems = []
    mine = {k for k, i in layout.items.items() if not i.optional}
    theirs = {k for k, v in saved.items() if not v.get("optional")}
    if strict:
        missing = sorted(mine - set(saved))
        unexpected = sorted(theirs - set(layout.items) - set(layout.aliases))
        unexpected += sorted(k for k in objects if k not in layout.restore and k != _RNG_KEY)
        if missing:
            problems.append(f"missing in the checkpoint: {_some(missing)}")
        if unexpected:
            problems.append(f"in the checkpoint but not in the state to load: {_some(unexpected)}")
        gone = sorted(k for k in layout.restore if k not in objects)
        if gone:
            problems.append(f"objects missing in the checkpoint: {_some(gone)}")
    for key, item in layout.items.items():
        if key in saved:
            shape, dtype = tuple(saved[key]["shape"]), _dtype(saved[key]["dtype"])
            if shape != item.shape:
                problems.append(f"'{key}': shape {list(item.shape)} here, {list(shape)} in the checkpoint")
            elif dtype != item.dtype and not item.optional:
                problems.append(f"'{key}': dtype {item.dtype} here, {dtype} in the checkpoint")
    if problems:
        raise ValueError(f"cannot load {root}: " + "; ".join(problems)
                         + (" (strict=False ignores keys present on one side only)" if strict else ""))


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _plan_reads(layout: Layout, saved: dict) -> list[tuple]:
    """(key, saved chunk, dtype, overlap box, destination view) for every overlap of a
    box this rank holds with a saved box."""
    reads = []
    for key, item in layout.items.items():
        if key in saved and key not in layout.aliases:
            for piece in item.pieces:
                if not piece.tensor.is_meta:  # deferred tensors are bound, not read (_bind_deferred)
                    reads += _reads_for(key, saved[key], piece.box, piece.tensor)
    return reads


def _reads_for(key: str, entry: dict, box: Box, dest: torch.Tensor) -> list[tuple]:
    dtype, reads, covered = _dtype(entry["dtype"]), [], 0
    for chunk in entry["chunks"]:
        overlap = box.intersect(Box.from_json(chunk["box"]))
        if overlap is not None:
            reads.append((key, chunk, dtype, overlap, overlap.view_of(dest, box)))
            covered += overlap.numel()
    if covered < box.numel():
        raise ValueError(f"'{key}': the checkpoint covers {covered} of the {box.numel()} elements of box {box} "
                         "(a save from an incomplete set of ranks?)")
    return reads


def _bind_deferred(layout: Layout, saved: dict, reader: Reader) -> None:
    """Tensors of a vescale.deferred_init model not materialised yet take their values
    from the checkpoint when they are (each rank reading its own shard then): their
    random initialisation never runs."""
    from ..deferred import bind_source, is_deferred

    for key, item in layout.items.items():
        if key not in saved or not item.pieces or not is_deferred(item.pieces[0].tensor):
            continue

        def read(box: Box, key=key, entry=saved[key]) -> torch.Tensor:
            out = torch.empty(box.sizes, dtype=_dtype(entry["dtype"]))
            reads = _reads_for(key, entry, box, out)
            for k, chunk, dtype, overlap, _ in reads:
                reader.verify(k, chunk, dtype, overlap)
            for _, chunk, dtype, overlap, dest in reads:
                dest.copy_(reader.view(chunk, dtype, overlap))
            return out

        bind_source(item.pieces[0].tensor, read)


def _masters_from_parameters(state: dict, layout: Layout, saved: dict) -> None:
    """ZeRO master weights that the checkpoint lacks (it was saved without ZeRO) start
    from the parameters just loaded."""
    from ..deferred import flat_slice
    from ..parallel.optimizer import DistributedOptimizer

    for key, opt in state.items():
        if not isinstance(opt, DistributedOptimizer) or any(k.startswith(f"{key}.master.") for k in saved):
            continue
        for o in opt.owned:
            source = (opt.sharded.slice_of(o.param) if opt.sharded is not None
                      else flat_slice(o.param, o.start, o.end))
            o.master.copy_(source.to(o.master.dtype))
