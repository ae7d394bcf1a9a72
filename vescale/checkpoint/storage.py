"""The bytes of a checkpoint: one data file per writing rank, chunks back to back, each
chunk one saved box in row-major order, with a CRC32 per 4 MiB block so that a reader
of part of a chunk verifies only the blocks it touches; small files (the objects'
JSON) with one CRC32 of the whole file.

Reading trusts nothing it is given: file names must be plain names inside the
checkpoint directory, every record must fit its file, and nothing is ever unpickled."""

from __future__ import annotations

import os
import re
import threading
import warnings
import zlib

import numpy as np
import torch

from ..boxes import Box

BLOCK = 4 << 20  # bytes per checksum
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # no separators, no "..", not absolute


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file is missing, truncated, damaged, or not what vescale.save writes."""


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes, any dtype (bfloat16 too), as a uint8 array without a copy when
    contiguous and in host memory (a GPU tensor is copied there)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def checksums(data) -> list[int]:
    view = memoryview(data)
    return [zlib.crc32(view[i:i + BLOCK]) for i in range(0, len(view), BLOCK)]


def write_file(path: str, chunks: list[tuple[str, Box, torch.Tensor]]) -> list[dict]:
    """Writes the chunks to ``path`` and returns their manifest records. The checksums
    are computed while the file is being flushed to disk (zlib and fsync both release
    the GIL), so they cost no time of their own."""
    datas = [as_bytes(tensor) for _, _, tensor in chunks]
    with open(path, "wb") as f:
        for data in datas:
            f.write(memoryview(data))
        f.flush()
        syncing = threading.Thread(target=os.fsync, args=(f.fileno(),))
        syncing.start()
        crcs = [checksums(data) for data in datas]
        syncing.join()
    records, offset = [], 0
    for (key, box, _), data, crc in zip(chunks, datas, crcs):
        records.append(dict(key=key, box=box.to_json(), file=os.path.basename(path), offset=offset,
                            nbytes=len(data), crc32=crc))
        offset += len(data)
    return records


def inside(root: str, name, source: str) -> str:
    """root/name for a file name read from the file ``source`` (a manifest, an index),
    refused unless it stays inside root: a crafted file must not make a load read files
    elsewhere (``../../etc/passwd``, an absolute path, a symbolic link out of root)."""
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name):
        raise CorruptCheckpoint(f"{source}: refers to the file {name!r}, which is not a plain file name (absolute "
                                "paths, '..' and separators are refused): it is damaged or crafted; do not load it")
    path, real_root = os.path.join(root, name), os.path.realpath(root)
    if os.path.commonpath([os.path.realpath(path), real_root]) != real_root:
        raise CorruptCheckpoint(f"{path}: a link to {os.path.realpath(path)}, outside {root}; the files of a "
                                "checkpoint must be inside its directory: do not load it")
    return path


class Reader:
    """Reads parts of saved chunks through a read-only memory map: only the pages a
    rank's boxes touch are read from disk. ``files`` is the manifest's {name: {"nbytes":
    size, "crc32": checksum of the whole file (small files only)}}: every name is checked
    to stay inside ``root`` and every size is checked on construction."""

    def __init__(self, root: str, files: dict[str, dict], manifest: str):
        self.root, self.files, self.manifest = root, files, manifest
        self._maps: dict[str, np.memmap] = {}
        self._verified: set[tuple[str, int]] = set()
        for name, entry in files.items():
            path = self.path(name)
            actual = os.path.getsize(path) if os.path.exists(path) else None
            if actual != entry["nbytes"]:
                raise CorruptCheckpoint(f"{path}: expected {entry['nbytes']} bytes, found "
                                        f"{'no file' if actual is None else actual}: the checkpoint is truncated "
                                        "or incomplete; load an earlier one")

    def path(self, name) -> str:
        """root/name, for a name that the manifest's 'files' lists (see ``inside``)."""
        if not isinstance(name, str) or name not in self.files:
            raise CorruptCheckpoint(f"{self.manifest}: refers to the file {name!r}, which its 'files' does not list: "
                                    "the manifest is damaged or crafted; do not load it")
        return inside(self.root, name, self.manifest)

    def read_whole(self, name: str) -> bytes:
        """The bytes of a small file, checked against the CRC32 of the whole file."""
        with open(self.path(name), "rb") as f:
            data = f.read()
        if zlib.crc32(data) != self.files[name].get("crc32"):
            raise CorruptCheckpoint(f"{self.path(name)}: checksum mismatch: the file is corrupted; nothing was "
                                    "loaded; load an earlier checkpoint")
        return data

    def _map(self, name: str) -> np.memmap:
        if name not in self._maps:
            self._maps[name] = np.memmap(self.path(name), dtype=np.uint8, mode="r")
        return self._maps[name]

    def view(self, chunk: dict, dtype: torch.dtype, want: Box) -> torch.Tensor:
        """The part ``want`` of a saved chunk: a view of the read-only map (copy it out)."""
        saved = Box.from_json(chunk["box"])
        raw = self._map(chunk["file"])[chunk["offset"]:chunk["offset"] + chunk["nbytes"]]
        with warnings.catch_warnings():  # read-only map: only ever copied from
            warnings.simplefilter("ignore")
            whole = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
        return want.view_of(whole.view(dtype).view(saved.sizes), saved)

    def verify(self, key: str, chunk: dict, dtype: torch.dtype, want: Box) -> None:
        """Checks the CRC32 of every block of the chunk that the part ``want`` touches."""
        self._check_record(key, chunk, dtype)
        part = self.view(chunk, dtype, want)
        if part.numel() == 0:
            return
        item = part.element_size()
        start = part.storage_offset() * item  # the view starts at the chunk's first byte
        first = start
        last = start + item * (1 + sum((n - 1) * s for n, s in zip(part.shape, part.stride())))
        raw = self._map(chunk["file"])
        for b in range(first // BLOCK, (last - 1) // BLOCK + 1):
            tag = (chunk["file"], chunk["offset"] + b * BLOCK)
            if tag in self._verified:
                continue
            lo = chunk["offset"] + b * BLOCK
            hi = min(lo + BLOCK, chunk["offset"] + chunk["nbytes"])
            if zlib.crc32(memoryview(raw[lo:hi])) != chunk["crc32"][b]:
                raise CorruptCheckpoint(f"{self.path(chunk['file'])}: checksum mismatch in block {b} of '{key}' "
                                        f"(bytes {lo} to {hi} of the file): the file is corrupted; load an earlier "
                                        "checkpoint")
            self._verified.add(tag)

    def _check_record(self, key: str, chunk: dict, dtype: torch.dtype) -> None:
        """A chunk's record must fit its file and its box: the manifest's checksum only
        shows that nothing changed since it was written, not who wrote it."""
        self.path(chunk["file"])  # a listed, plain name
        size = self.files[chunk["file"]]["nbytes"]
        offset, nbytes = chunk["offset"], chunk["nbytes"]
        if (nbytes != Box.from_json(chunk["box"]).numel() * dtype.itemsize or offset < 0 or offset + nbytes > size
                or len(chunk["crc32"]) != -(-nbytes // BLOCK)):
            raise CorruptCheckpoint(f"{self.manifest}: the record of '{key}' (bytes {offset} to {offset + nbytes} of "
                                    f"{chunk['file']}, {len(chunk['crc32'])} checksums) does not fit the file or the "
                                    "tensor: this manifest was not written by vescale.save; do not load it")
