"""What a checkpoint directory holds, by name and format version, and the manifest that
lists it: written by writing.py, read and verified before anything else by loading.py.
The manifest carries a CRC32 of its own content, checked before anything in it is used."""

from __future__ import annotations

import json
import os
import zlib

import torch

from .storage import CorruptCheckpoint

MANIFEST, OBJECTS, OBJECT_TENSORS = "manifest.json", "objects.json", "objects.bin"
FORMAT = "vescale-checkpoint/2"
_PICKLED_FORMAT = "vescale-checkpoint/1"  # objects.pt, a pickle: refused
_RNG_KEY = "__rng_state__"


def _crc_of(manifest: dict) -> int:
    """The manifest's own checksum, of its content (keys sorted): a flipped digit in a
    shape, offset or size still parses, and would go unnoticed without it."""
    return zlib.crc32(json.dumps(manifest, sort_keys=True).encode())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


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
