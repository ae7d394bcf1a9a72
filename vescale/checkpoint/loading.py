"""vescale.load: all or nothing.

Every rank reads the manifest, checks it against its own state (missing or unexpected
keys, shapes, dtypes), and verifies the checksum of every block it will read, through a
memory map of only the byte ranges of saved boxes that overlap the boxes it holds now;
then the ranks agree in one collective (agreement.py), and either all load or all raise
the same error, naming the rank that found it. A pipeline stage loads its own tensors
and leaves the other stages' keys to them.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import torch

from ..boxes import Box
from .agreement import _agree, _checkpoint_group, _rank_world
from .layout import Layout, build
from .manifest import _RNG_KEY, MANIFEST, OBJECTS, _crc_of, _dtype, _read_manifest
from .saving import _pending
from .storage import CorruptCheckpoint, Reader
from .values import decode


@dataclass
class _Load:
    """Everything a load will do, verified on this rank but not done yet."""
    layout: Layout
    saved: dict      # the manifest's tensors, aliases included
    reader: Reader
    objects: dict    # decoded
    copies: list     # _plan_reads
    read_from: str   # the directory and its manifest's checksum: the same on every rank


def load(path: str, state: dict, *, strict: bool = True, rng: bool = True) -> None:
    """Loads a checkpoint written by vescale.save into ``state`` in place, whatever mesh,
    placements, world size or ZeRO stage it was saved from. Every rank verifies all it
    will read and checks the checkpoint against its state first; if any rank finds a
    problem, every rank raises the same error and none changes anything: ValueError when
    keys, shapes or dtypes do not match (``strict=False`` ignores keys only one side
    has), CorruptCheckpoint for a damaged, truncated or foreign file."""
    _pending.wait()
    plan, error = None, None
    try:
        plan = _prepare(path, state, strict)
    except Exception as e:  # noqa: BLE001  (shared with the other ranks, then raised on all)
        error = e
    _agree(_checkpoint_group(), error, "no rank loaded anything", same=plan.read_from if plan else None)
    _commit(plan, state, rng)


def _prepare(path: str, state: dict, strict: bool) -> _Load:
    root = _resolve(path)
    manifest = _read_manifest(root)
    reader = Reader(root, manifest["files"], os.path.join(root, MANIFEST))
    saved = manifest["tensors"]
    for alias, first in manifest.get("aliases", {}).items():
        saved.setdefault(alias, saved[first])
    layout = build(state, {k: (tuple(v["shape"]), _dtype(v["dtype"])) for k, v in saved.items()})
    objects = _read_objects(reader)
    _check(layout, saved, objects, strict, root)
    copies = _plan_reads(layout, saved)
    for key, chunk, dtype, overlap, _ in copies:
        reader.verify(key, chunk, dtype, overlap)
    return _Load(layout, saved, reader, objects, copies, f"{root} (manifest {_crc_of(manifest):08x})")


def _commit(plan: _Load, state: dict, rng: bool) -> None:
    for install in plan.layout.installs:
        install()
    with torch.no_grad():
        for _, chunk, dtype, overlap, dest in plan.copies:
            if not dest.is_meta:  # deferred tensors are bound, not read (_bind_deferred)
                dest.copy_(plan.reader.view(chunk, dtype, overlap))
        _masters_from_parameters(state, plan.layout, plan.saved)
        for finish in plan.layout.finishes:
            finish()
    _bind_deferred(plan.layout, plan.saved, plan.reader)
    for key, restore in plan.layout.restore.items():
        if key in plan.objects:
            restore(plan.objects[key])
    if rng and _RNG_KEY in plan.objects:
        _restore_rng(plan.objects[_RNG_KEY])


def _restore_rng(saved) -> None:
    """Each rank's own saved state; where the ranks' states differed and the world size
    changed since, none (which rank's stream goes where is not known) and a warning."""
    if isinstance(saved, torch.Tensor):
        torch.set_rng_state(saved)
        return
    rank, world = _rank_world(_checkpoint_group())
    if len(saved) == world:
        torch.set_rng_state(saved[rank])
    else:
        warnings.warn(f"vescale.load: the checkpoint holds a different CPU random state for each of its "
                      f"{len(saved)} ranks, and this job has {world}: the random state is left as it is "
                      "(load(..., rng=False) says so without a warning)", stacklevel=3)


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    if os.path.exists(os.path.join(f"{path}.old", MANIFEST)):
        return f"{path}.old"  # a save crashed between its two renames
    raise FileNotFoundError(f"no vescale checkpoint at {path} (no {MANIFEST})")


def _read_objects(reader: Reader) -> dict:
    """The non-tensor state: objects.json (checked against its CRC32 before it is
    parsed) with its tensors from objects.bin (each verified)."""
    text = reader.read_whole(OBJECTS)
    try:
        doc = json.loads(text)
        tensors = []
        for i, record in enumerate(doc["tensors"]):
            dtype, box = _dtype(record["dtype"]), Box.from_json(record["box"])
            reader.verify(f"objects tensor {i}", record, dtype, box)
            tensors.append(reader.view(record, dtype, box).clone())
        return decode(doc["values"], tensors)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise CorruptCheckpoint(f"{reader.path(OBJECTS)}: malformed ({type(e).__name__}: {e}) although its "
                                "checksum matches: it was not written by vescale.save; do not load it") from None


def _check(layout: Layout, saved: dict, objects: dict, strict: bool, root: str) -> None:
    problems = []
    mine = {k for k, i in layout.items.items() if not i.optional}
    theirs = {k for k, v in saved.items() if not v.get("optional")}
    if strict:
        missing = sorted(mine - set(saved))
        # keys of other pipeline stages' tensors are theirs to load
        unexpected = sorted(k for k in theirs - set(layout.items) - set(layout.aliases)
                            if not layout.held_elsewhere(k))
        unexpected += sorted(k for k in objects if k not in layout.restore and k != _RNG_KEY
                             and not layout.held_elsewhere(k))
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
    for key, validate in layout.validate.items():
        problem = validate(objects[key]) if key in objects else None
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError(f"cannot load {root}: " + "; ".join(problems)
                         + (" (strict=False ignores keys present on one side only)" if strict else ""))


def _some(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _plan_reads(layout: Layout, saved: dict) -> list[tuple]:
    """(key, saved chunk, dtype, overlap box, destination view) for every overlap of a
    box this rank holds with a saved box. Those of deferred tensors are verified with
    the rest (for the box they have now) but read only when they are materialised."""
    from ..deferred import is_deferred

    reads = []
    for key, item in layout.items.items():
        if key in saved and key not in layout.aliases:
            for piece in item.pieces:
                if not piece.tensor.is_meta or is_deferred(piece.tensor):
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
