"""Weights in the formats the rest of the ecosystem reads and writes.

    vescale.checkpoint.export_hf("out/hf", model, max_shard_size="2GB")
    vescale.checkpoint.import_hf("out/hf", model)               # into any mesh / placements
    vescale.checkpoint.load_torch_state_dict("model.pt", model)  # a single-device torch.save

Export writes a Hugging Face-style directory: safetensors files of at most
``max_shard_size`` and ``model.safetensors.index.json``. Files are spread over the
ranks; each tensor is gathered onto the rank that writes it, and only there, so no
rank ever holds more than one file's tensors. Import reads, on each rank, only the
slices of its own boxes (safetensors' lazy slices; torch.load with mmap).
"""

from __future__ import annotations

import json
import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn

from ..boxes import Box
from ..deferred import materialize_before_reading
from ..parallel.optimizer import collective_device
from .layout import Item, build
from .storage import inside

INDEX = "model.safetensors.index.json"

__all__ = ["export_hf", "full_state_dict", "import_hf", "load_torch_state_dict"]


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)\s*", size.upper().replace("IB", "iB"))
    if not m:
        raise ValueError(f"max_shard_size {size!r}: give bytes as an int or a string like '500MB' or '2GB'")
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return int(float(m.group(1)) * units[m.group(2)])


def _files(sizes: list[int], limit: int) -> list[int]:
    """The file of each tensor, in order: a new file when the next tensor would overflow."""
    index, used, out = 0, 0, []
    for n in sizes:
        if used and used + n > limit:
            index, used = index + 1, 0
        out.append(index)
        used += n
    return out


def _model_items(model: nn.Module, optimizer) -> list[tuple[str, Item, list]]:
    """Every tensor of the model as (name, this rank's item, every rank's boxes of it),
    in one order on every rank (pipeline stages hold different tensors)."""
    world = dist.get_world_size()
    materialize_before_reading(model)
    layout = build({"model": model, **({"optimizer": optimizer} if optimizer is not None else {})})
    mine = {k[len("model."):]: i for k, i in layout.items.items() if k.startswith("model.")}
    held: list = [None] * world
    dist.all_gather_object(held, {n: (i.shape, i.dtype, [p.box.to_json() for p in i.pieces])
                                  for n, i in mine.items()})
    items, listed = [], set()
    for theirs in held:
        for n, (shape, dtype, _) in theirs.items():
            if n not in listed:
                listed.add(n)
                items.append((n, mine.get(n, Item(f"model.{n}", shape, dtype))))  # no pieces on this rank
    return [(n, item, [[Box.from_json(b) for b in theirs[n][2]] if n in theirs else [] for theirs in held])
            for n, item in items]


def export_hf(directory: str, model: nn.Module, *, max_shard_size: int | str = "5GB", optimizer=None) -> None:
    """Writes the model as safetensors shards with an index. Every rank must call it.
    Pass the DistributedOptimizer of a ZeRO-3 model (its parameters live as slices)."""
    limit = _bytes(max_shard_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    items = _model_items(model, optimizer)
    sizes = [math.prod(i.shape) * i.dtype.itemsize for _, i, _ in items]
    file_of = _files(sizes, limit)
    count = file_of[-1] + 1 if items else 0
    names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                      for i in range(count)]
    from safetensors.torch import save_file

    # A write can fail on one rank (a full disk, a directory not shared): that rank keeps
    # taking part in the gathers, writing nothing more, and at the end every rank raises.
    failed = _Writes()
    failed.attempt(lambda: os.makedirs(directory, exist_ok=True))  # every rank: a writer may not wait for rank 0
    pending: dict[str, torch.Tensor] = {}
    for n, (name, item, boxes) in enumerate(items):
        writer = file_of[n] % world
        full = _gather_to(item, boxes, writer)
        if rank == writer:
            pending[name] = full
            if n + 1 == len(items) or file_of[n + 1] != file_of[n]:  # the file is complete
                file = os.path.join(directory, names[file_of[n]])
                failed.attempt(lambda: save_file(pending, file, metadata={"format": "pt"}))
                pending = {}
    if rank == 0 and count > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {name: names[f] for (name, _, _), f in zip(items, file_of)}}
        failed.attempt(lambda: _write_json(os.path.join(directory, INDEX), index))
    failed.agree(f"the export to {directory} is incomplete")


class _Writes:
    """The first error of a rank's writes; ``agree`` raises it on every rank."""

    def __init__(self):
        self.error: Exception | None = None

    def attempt(self, write) -> None:
        if self.error is None:
            try:
                write()
            except OSError as e:
                self.error = e

    def agree(self, outcome: str) -> None:
        from .agreement import _agree, _checkpoint_group

        _agree(_checkpoint_group(), self.error, outcome)


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def export_torch(path: str, model: nn.Module, *, optimizer=None) -> None:
    """Writes the model's whole state_dict, gathered, as one ``torch.save`` file on rank 0
    (the file a single-device ``model.load_state_dict(torch.load(path))`` reads; tied
    parameters appear under their first name). Every rank must call it. Pass the
    DistributedOptimizer of a ZeRO-3 model."""
    rank = dist.get_rank()
    state = {}
    for name, item, boxes in _model_items(model, optimizer):
        full = _gather_to(item, boxes, 0)
        if rank == 0:
            state[name] = full
    failed = _Writes()
    if rank == 0:
        def write():
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)

        failed.attempt(write)
    failed.agree(f"{path} was not written")


def full_state_dict(model: nn.Module, *, optimizer=None) -> dict[str, torch.Tensor]:
    """The model's whole state on every rank, as one device's ``model.state_dict()`` holds
    it: plain CPU tensors gathered from tensor-parallel shards, pipeline stages and (pass
    its DistributedOptimizer) ZeRO-3 slices; tied parameters under their first name.
    Every rank must call it (collectives); it costs the whole model's memory on every
    rank, so checkpoints of big models go through ``vescale.save`` instead."""
    state, device = {}, collective_device()
    for name, item, boxes in _model_items(model, optimizer):
        full = _gather_to(item, boxes, 0)
        if dist.get_rank() != 0:
            full = torch.empty(item.shape, dtype=item.dtype)
        sent = full.contiguous().to(device)
        dist.broadcast(sent, src=0)
        state[name] = sent.cpu()
    return state


def _gather_to(item, boxes: list[list[Box]], dst: int) -> torch.Tensor | None:
    """The whole tensor of ``item`` on rank ``dst`` (None elsewhere), from the boxes each
    rank holds (``boxes[rank]``): each rank's pieces, flat and padded to the longest, in
    one gather; none when ``dst`` holds the whole tensor itself."""
    rank, origin = dist.get_rank(), Box((0,) * len(item.shape), tuple(item.shape))
    if boxes[dst] == [origin]:
        return item.pieces[0].tensor.contiguous() if rank == dst else None
    width = max(sum(b.numel() for b in rb) for rb in boxes)
    mine = torch.zeros(width, dtype=item.dtype)
    if item.pieces:
        flat = torch.cat([p.tensor.reshape(-1) for p in item.pieces])
        mine[: flat.numel()] = flat
    parts = [torch.empty(width, dtype=item.dtype) for _ in boxes] if rank == dst else None
    dist.gather(mine, parts, dst=dst)
    if rank != dst:
        return None
    full = torch.empty(item.shape, dtype=item.dtype)
    for r, rb in enumerate(boxes):
        pos = 0
        for box in rb:
            box.view_of(full, origin).copy_(parts[r][pos:pos + box.numel()].view(box.sizes))
            pos += box.numel()
    return full


def import_hf(directory: str, model: nn.Module, *, optimizer=None, strict: bool = True) -> None:
    """Fills the model's shards from a Hugging Face-style safetensors directory. Every rank
    calls it; an error on any rank is raised on every rank."""
    _agreed(lambda: _import_hf(directory, model, optimizer, strict), directory)


def _agreed(prepare, where: str) -> None:
    """``prepare()`` (the checks, returning the copy to do) on this rank, the ranks agree,
    then the copy, and they agree again: a file one rank cannot see or read, or a
    mismatch only its shards meet, raises on every rank (a rank raising alone left the
    others to wait for it in their next collective), and a check that fails on any rank
    changes no rank's model."""
    from .agreement import _agree, _checkpoint_group

    group = _checkpoint_group()
    if group is None:  # one process: its errors as they are
        prepare()()
        return
    copy, error = None, None
    try:
        copy = prepare()
    except Exception as e:  # noqa: BLE001  (shared with the other ranks, then raised on all)
        error = e
    _agree(group, error, f"loading {where}: no rank changed its model")
    try:
        copy()
    except Exception as e:  # noqa: BLE001
        error = e
    _agree(group, error, f"loading {where}: the ranks' models may be partly filled")


def _import_hf(directory: str, model: nn.Module, optimizer, strict: bool):
    from safetensors import safe_open

    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise FileNotFoundError(f"{directory}: neither {INDEX} nor model.safetensors")
    handles = {}

    def open_file(name):
        if name not in handles:
            handles[name] = safe_open(inside(directory, name, index), framework="pt")
        return handles[name]

    def shape_of(name):
        return tuple(open_file(weight_map[name]).get_slice(name).get_shape())

    def read(name, box: Box):
        part = open_file(weight_map[name]).get_slice(name)[tuple(slice(o, o + s) for o, s in zip(box.offsets,
                                                                                                  box.sizes))]
        return part.reshape(box.sizes)

    return _fill_model(model, optimizer, set(weight_map), shape_of, read, strict, directory)


def load_torch_state_dict(source, model: nn.Module, *, optimizer=None, strict: bool = True) -> None:
    """Fills the model's shards from a single-device ``state_dict`` (a path to a
    ``torch.save`` file, memory-mapped so each rank reads only its slices, or a dict).
    Every rank calls it; an error on any rank is raised on every rank."""
    where = source if isinstance(source, str) else "the state_dict"

    def prepare():
        state = torch.load(source, mmap=True, weights_only=True, map_location="cpu") if isinstance(source, str) \
            else source
        return _fill_model(model, optimizer, set(state), lambda n: tuple(state[n].shape),
                           lambda n, box: box.view_of(state[n], Box((0,) * state[n].dim(), tuple(state[n].shape))),
                           strict, where)

    _agreed(prepare, where)


def _fill_model(model, optimizer, available: set, shape_of, read, strict: bool, where: str):
    """Checks the source against the model; returns the copy into the model's shards."""
    state = {"model": model}
    if optimizer is not None:
        state["optimizer"] = optimizer
    layout = build(state)
    wanted = {k[len("model."):]: item for k, item in layout.items.items() if k.startswith("model.")}
    aliases = {a[len("model."):] for a in layout.aliases}
    problems = []
    missing = sorted(set(wanted) - available)
    unexpected = sorted(k for k in available - set(wanted) - aliases if not layout.held_elsewhere(f"model.{k}"))
    if strict and missing:
        problems.append(f"missing in {where}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if strict and unexpected:
        problems.append(f"not in the model: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    for name, item in wanted.items():
        if name in available and shape_of(name) != item.shape:
            problems.append(f"'{name}': shape {list(item.shape)} in the model, {list(shape_of(name))} in {where}")
    if problems:
        raise ValueError(f"cannot load {where} into the model: " + "; ".join(problems))

    @torch.no_grad()
    def copy():
        for name, item in wanted.items():
            if name in available:
                for piece in item.pieces:
                    piece.tensor.copy_(read(name, piece.box).to(piece.tensor.dtype))
        if optimizer is not None:
            from .loading import _masters_from_parameters
            _masters_from_parameters(state, layout, {})

    return copy
