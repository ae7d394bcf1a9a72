"""The checkpoint directory on disk, written all or nothing. Each rank writes its data
file into a temporary directory; rank 0 writes the non-tensor state as ``objects.json``
with its tensors in ``objects.bin`` (never a pickle: see values.py), and
``manifest.json`` (per tensor: global shape, dtype, saved boxes with file offsets and
CRC32s, and the placements it was saved from; every file's size; the CRC32 of
objects.json; a CRC32 of the manifest itself). The directory is renamed into place only
when everything is on disk: a crash mid-save leaves the previous checkpoint as it was,
and the next save removes the crashed one's directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import torch
import torch.distributed as dist

from ..boxes import whole
from .agreement import _agree, _all_gather
from .manifest import FORMAT, MANIFEST, OBJECT_TENSORS, OBJECTS, _crc_of, _dtype_name
from .storage import write_file


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
