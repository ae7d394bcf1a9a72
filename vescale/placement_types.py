"""Placements: how one mesh dimension lays out a DTensor.

``Shard(d)`` splits tensor dim ``d`` across the mesh dimension (``torch.chunk`` sizes,
so uneven sizes are fine), ``Replicate()`` gives every rank the whole tensor, and
``Partial(op)`` gives every rank a partial value whose reduction is the tensor.
``InterleavedShard(d, groups)`` sees dim ``d`` as ``groups`` equal blocks (the q, k and v
of a fused projection) and splits each block evenly: rank r holds piece r of every
block, side by side, so a fused QKV weight gives each rank whole heads of q, k and v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Placement", "Shard", "Replicate", "Partial", "InterleavedShard"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of the three placements."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)

    def is_interleaved(self) -> bool:
        return isinstance(self, InterleavedShard)

    def splits(self) -> bool:
        """Whether each rank holds a part of the tensor on this mesh dim (Shard or
        InterleavedShard), not all of it."""
        return isinstance(self, (Shard, InterleavedShard))


@dataclass(frozen=True)
class Shard(Placement):
    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) takes an int tensor dim, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class InterleavedShard(Placement):
    """Tensor dim ``dim`` is ``groups`` equal blocks laid end to end; each block is split
    evenly over the mesh dim and rank r holds piece r of every block. Example: a fused
    QKV weight of shape (3 * C, C) as ``InterleavedShard(0, 3)`` on 2 ranks gives rank 0
    the first halves of q, k and v, rank 1 the second halves. The dim must divide into
    ``groups`` x mesh-dim-size pieces, and no other mesh dim may split the same dim."""
    dim: int
    groups: int

    def __post_init__(self):
        for name in ("dim", "groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"InterleavedShard({name}) takes an int, got {v!r}")
        if not 2 <= self.groups <= 63:
            raise ValueError(f"InterleavedShard(dim, groups) needs 2 <= groups <= 63, got {self.groups} "
                             f"(for one group use Shard({self.dim}))")

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, groups={self.groups})"


@dataclass(frozen=True)
class Replicate(Placement):
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op) must be one of {_REDUCE_OPS}, got {self.reduce_op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


def to_c(placements: Iterable[Placement]) -> list[tuple]:
    """Placements as the tuples vescale._C takes."""
    out = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(("S", p.dim))
        elif isinstance(p, Replicate):
            out.append(("R",))
        elif isinstance(p, Partial):
            out.append(("P", p.reduce_op))
        elif isinstance(p, InterleavedShard):
            out.append(("I", p.dim, p.groups))
        else:
            raise TypeError(
                f"expected vescale placements (Shard(d), Replicate(), Partial(), InterleavedShard(d, groups)), "
                f"got {p!r} of type {type(p).__name__}")
    return out


def from_c(tuples: Sequence[tuple]) -> tuple[Placement, ...]:
    out = []
    for t in tuples:
        kind = t[0]
        out.append(Shard(t[1]) if kind == "S" else Replicate() if kind == "R" else
                   InterleavedShard(t[1], t[2]) if kind == "I" else Partial(t[1]))
    return tuple(out)
