"""vescale.save / vescale.load: sharded checkpoints that load into any mesh.

    vescale.save("ckpt/step100", {"model": model, "optimizer": opt, "lr_scheduler": sched})
    vescale.load("ckpt/step100", {"model": model, "optimizer": opt, "lr_scheduler": sched})

Saving: every rank lists the boxes it holds (the ranks of a pipeline hold different
tensors: the manifest lists all of them); boxes held by several ranks (replicated
data, a weight tied across pipeline stages) are written once, by the holder that has
written least so far, so the writing spreads over the ranks. Each rank writes one
data file into a temporary directory; rank 0 writes the non-tensor state (scheduler
state, hyperparameters, RNG state, the user's Python values; what only some ranks
have, or each rank a part of, gathered) as ``objects.json`` with its tensors in
``objects.bin`` (never a pickle: see values.py), and ``manifest.json`` (per tensor:
global shape, dtype, saved boxes with file offsets and CRC32s, and the placements it
was saved from; every file's size; the CRC32 of objects.json; a CRC32 of the manifest
itself). The directory is renamed into place only when everything is on disk: a
crash mid-save leaves the previous checkpoint as it was, and the next save removes
the crashed one's directory.

Loading is all or nothing: every rank reads the manifest, checks it against its own
state (missing or unexpected keys, shapes, dtypes), and verifies the checksum of every
block it will read, through a memory map of only the byte ranges of saved boxes that
overlap the boxes it holds now; then the ranks agree in one collective, and either all
load or all raise the same error, naming the rank that found it. A pipeline stage loads
its own tensors and leaves the other stages' keys to them.

Without torch.distributed (no process group), a single process saves and loads alone.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import threading
import uuid
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..boxes import Box, whole
from ..deferred import materialize_before_reading
from ..device_mesh import collective_timeout, of_this_world, release_at_exit
from .layout import Layout, build
from .storage import CorruptCheckpoint, Reader, write_file
from .values import decode, encode

MANIFEST, OBJECTS, OBJECT_TENSORS = "manifest.json", "objects.json", "objects.bin"
FORMAT = "vescale-checkpoint/2"
_PICKLED_FORMAT = "vescale-checkpoint/1"  # objects.pt, a pickle: refused
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
# A process group of its own, so that a background save never mixes with training
# collectives: (the world it was made in, the group), as device_mesh.of_this_world keeps it.
_group: tuple | None = None
atexit.register(lambda: _pending.thread and _pending.thread.join())


def _forget_group() -> None:
    global _group
    _group = None


release_at_exit(_forget_group)


def wait() -> None:
    """Blocks until an asynchronous save has finished (raises if it failed)."""
    _pending.wait()


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


def _checkpoint_group():
    """The checkpoint's process group; None in a process without torch.distributed,
    which then saves and loads alone."""
    global _group
    if not dist.is_initialized():
        return None
    # torch's default timeout would be 30 minutes
    _group = of_this_world(_group, lambda: dist.new_group(backend="gloo", timeout=collective_timeout()))
    return _group[1]


def _rank_world(group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _all_gather(obj, group) -> list:
    if group is None:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


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


# the errors that every rank raises as they are; any other becomes a RuntimeError naming it
_SHARED_ERRORS = {c.__name__: c for c in (CorruptCheckpoint, ValueError, TypeError, FileNotFoundError, OSError,
                                           PermissionError, FileExistsError, NotADirectoryError, IsADirectoryError)}


def _agree(group, error: Exception | None, outcome: str, same=None) -> None:
    """One collective in which the ranks tell each other what went wrong: then all go on,
    or all raise the same error, naming the first rank that found one (a rank going on
    alone would change its state while the others do not, or wait for them forever).
    ``same``: what every rank must have found alike (which checkpoint it read)."""
    gathered = _all_gather((None if error is None else (type(error).__name__, str(error)), same), group)
    reports = [report for report, _ in gathered]
    failed = [r for r, report in enumerate(reports) if report is not None]
    if not failed and any(s != gathered[0][1] for _, s in gathered):
        seen = ", ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(gathered))
        raise ValueError(f"the ranks read different checkpoints ({seen}): they see the file system differently "
                         f"(a copy on each machine? a save that crashed between its two renames, seen by some "
                         f"ranks only?); {outcome}")
    if not failed:
        return
    kind, message = reports[failed[0]]
    also = f"; ranks {', '.join(map(str, failed[1:]))} failed too" if len(failed) > 1 else ""
    cls = _SHARED_ERRORS.get(kind)
    raise (cls or RuntimeError)(f"{message if cls else f'{kind}: {message}'} "
                                f"[found by rank {failed[0]}{also}; {outcome}]") from error


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


def _write(path, tmp, chunks, meta, values, aliases, group, rank, world) -> None:
    # Each step on the disk can fail on one rank only (a full disk, a directory that is not
    # shared): the ranks agree after each, so that all raise that error (the others used to
    # wait for the failed rank until the collective timeout), and the unfinished directory
    # goes. The checkpoint already at `path` is kept until the last rename.
    kept = f"nothing was saved; a checkpoint already at {path} is as it was"

    def prepare():
        _remove_stale(path)
        os.makedirs(tmp, exist_ok=False)

    _on_disk(group, rank == 0, prepare, tmp, kept)
    records = _on_disk(group, True, lambda: write_file(os.path.join(tmp, f"data_{rank:05d}.bin"), chunks), tmp, kept)
    gathered = _all_gather(records, group)

    def finish():
        tensors = {k: dict(m, chunks=[]) for k, m in meta.items()}
        for recs in gathered:
            for r in recs:
                tensors[r["key"]]["chunks"].append({k: v for k, v in r.items() if k != "key"})
        files = {f"data_{r:05d}.bin": _entry(recs) for r, recs in enumerate(gathered)}
        files.update(_write_objects(tmp, *values))
        manifest = dict(format=FORMAT, world_size=world, tensors=tensors, aliases=aliases, files=files)
        _write_bytes(os.path.join(tmp, MANIFEST), json.dumps(dict(manifest, crc32=_crc_of(manifest))).encode())
        _replace(tmp, path)

    _on_disk(group, rank == 0, finish, tmp, kept)


def _on_disk(group, here: bool, step, tmp: str, outcome: str):
    """``step()`` where ``here`` (a part of a save that writes), then the ranks agree on how
    it went; on an error every rank raises it and the unfinished directory is removed."""
    result, error = None, None
    if here:
        try:
            result = step()
        except OSError as e:
            error = e
    try:
        _agree(group, error, outcome)
    except BaseException:
        if group is None or dist.get_rank(group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _entry(records: list[dict]) -> dict:
    """A data file's entry in the manifest's ``files``: its chunks' checksums cover it."""
    return {"nbytes": sum(r["nbytes"] for r in records)}


def _write_objects(tmp: str, encoded: dict, tensors: list[torch.Tensor]) -> dict:
    """objects.bin (the values' tensors, checksummed like data files) and objects.json
    (the values and those tensors' records); returns their entries for ``files``."""
    records = write_file(os.path.join(tmp, OBJECT_TENSORS),
                         [(f"objects tensor {i}", whole(t.shape), t) for i, t in enumerate(tensors)])
    for record, t in zip(records, tensors):
        record["dtype"] = _dtype_name(t.dtype)
    text = json.dumps({"values": encoded, "tensors": records}).encode()
    _write_bytes(os.path.join(tmp, OBJECTS), text)
    return {OBJECT_TENSORS: _entry(records), OBJECTS: {"nbytes": len(text), "crc32": zlib.crc32(text)}}


def _crc_of(manifest: dict) -> int:
    """The manifest's own checksum, of its content (keys sorted): a flipped digit in a
    shape, offset or size still parses, and would go unnoticed without it."""
    return zlib.crc32(json.dumps(manifest, sort_keys=True).encode())


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
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


def _remove_stale(path: str) -> None:
    """Removes the temporary directories (``path.tmp-<8 hex digits>``) that crashed saves
    to ``path`` left behind, and only those. None belongs to a save in progress: save
    waits for the previous (async) save of this process before it gets here, and
    concurrent saves to one path from several jobs are not supported anyway."""
    parent, base = os.path.split(os.path.abspath(path))
    stale = re.compile(re.escape(base) + r"\.tmp-[0-9a-f]{8}")
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        if stale.fullmatch(name):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------

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


def _rng_states(states: list[torch.Tensor]):
    """The CPU generator's state to save, from every rank's (in rank order): one state
    where they are all the same (vescale's random ops draw as one device does, from one
    seed on every rank), else each rank's, for a program that seeds its ranks apart."""
    return states[0] if all(torch.equal(s, states[0]) for s in states[1:]) else list(states)


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


def _read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    with open(path, "rb") as f:
        text = f.read()
    try:
        manifest = json.loads(text)
    except ValueError as e:  # not JSON, or not UTF-8
        raise CorruptCheckpoint(f"{path}: not valid JSON ({e}): the manifest is damaged or truncated; load an "
                                "earlier checkpoint") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{path}: not a vescale manifest (a JSON {type(manifest).__name__})")
    if manifest.get("format") == _PICKLED_FORMAT:  # before the checksum, which that format lacks
        raise ValueError(f"{root} is a {_PICKLED_FORMAT} checkpoint, an older format whose objects.pt is a pickle, "
                         "which can run arbitrary code when loaded: this vescale refuses it. If you trust where it "
                         "came from, load it with the vescale version that wrote it and save it again")
    if manifest.pop("crc32", None) != _crc_of(manifest):
        raise CorruptCheckpoint(f"{path}: checksum mismatch: the manifest is corrupted (or was edited); load an "
                                "earlier checkpoint")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{root}: checkpoint format {manifest.get('format')!r}; this vescale reads {FORMAT}")
    return manifest


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


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
