"""Boxes: rectangular pieces of a global tensor, given by per-dim offsets and sizes.

Everything a rank saves or loads is a box of some global tensor: a DTensor's local
shard is one box; a ZeRO slice (a flat element range of a local shard) is a few boxes.
Resharding is then box intersection, whatever the meshes and placements on either side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.sizes)

    def shifted(self, by: tuple[int, ...]) -> Box:
        return Box(tuple(o + b for o, b in zip(self.offsets, by)), self.sizes)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def view_of(self, tensor: torch.Tensor, origin: Box) -> torch.Tensor:
        """The part of ``tensor`` (which holds ``origin``) that this box covers."""
        out = tensor
        for d, (o, s, base) in enumerate(zip(self.offsets, self.sizes, origin.offsets)):
            out = out.narrow(d, o - base, s)
        return out

    def to_json(self) -> list:
        return [list(self.offsets), list(self.sizes)]

    @staticmethod
    def from_json(value: list) -> Box:
        return Box(tuple(value[0]), tuple(value[1]))


def whole(shape) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def flat_range(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Row-major elements [start, end) of a tensor of ``shape`` as boxes, in order; each
    box's elements are contiguous in the range (at most 2 * ndim - 1 boxes)."""
    if start >= end:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, end // inner
    rest = shape[1:]

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [Box((row, *b.offsets), (1, *b.sizes)) for b in flat_range(rest, lo, hi)]

    if first == last:
        return in_row(first, start - first * inner, end - first * inner)
    boxes = []
    if start % inner:
        boxes += in_row(first, start % inner, inner)
        first += 1
    if last > first:
        boxes.append(Box((first,) + (0,) * len(rest), (last - first, *rest)))
    if end % inner:
        boxes += in_row(last, 0, end % inner)
    return boxes
