"""The bytes of a checkpoint: one data file per writing rank, chunks back to back, each
chunk one saved box in row-major order, with a CRC32 per 4 MiB block so that a reader
of part of a chunk verifies only the blocks it touches."""

from __future__ import annotations

import os
import threading
import warnings
import zlib

import numpy as np
import torch

from ..boxes import Box

BLOCK = 4 << 20  # bytes per checksum


class CorruptCheckpoint(RuntimeError):
    """A data file is truncated or its bytes do not match the manifest's checksums."""


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes, any dtype (bfloat16 too), as a uint8 array without a copy when contiguous."""
    t = t.detach().contiguous()
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


class Reader:
    """Reads parts of saved chunks through a read-only memory map: only the pages a
    rank's boxes touch are read from disk."""

    def __init__(self, root: str, file_sizes: dict[str, int]):
        self.root = root
        self._maps: dict[str, np.memmap] = {}
        self._verified: set[tuple[str, int]] = set()
        for name, size in file_sizes.items():
            path = os.path.join(root, name)
            actual = os.path.getsize(path) if os.path.exists(path) else None
            if actual != size:
                raise CorruptCheckpoint(f"{path}: expected {size} bytes, found "
                                        f"{'no file' if actual is None else actual}: the checkpoint is truncated "
                                        "or incomplete; load an earlier one")

    def _map(self, name: str) -> np.memmap:
        if name not in self._maps:
            self._maps[name] = np.memmap(os.path.join(self.root, name), dtype=np.uint8, mode="r")
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
                raise CorruptCheckpoint(f"{os.path.join(self.root, chunk['file'])}: checksum mismatch in "
                                        f"'{key}' (bytes {lo} to {hi}): the file is corrupted; nothing was "
                                        "loaded; load an earlier checkpoint")
            self._verified.add(tag)
