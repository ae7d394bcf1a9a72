"""Placements: how one mesh dimension lays out a DTensor.

``Shard(d)`` splits tensor dim ``d`` across the mesh dimension (``torch.chunk`` sizes,
so uneven sizes are fine), ``Replicate()`` gives every rank the whole tensor, and
``Partial(op)`` gives every rank a partial value whose reduction is the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Placement", "Shard", "Replicate", "Partial"]

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of the three placements."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) takes an int tensor dim, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


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
        else:
            raise TypeError(
                f"expected vescale placements (Shard(d), Replicate(), Partial()), got {p!r} "
                f"of type {type(p).__name__}")
    return out


def from_c(tuples: Sequence[tuple]) -> tuple[Placement, ...]:
    out = []
    for t in tuples:
        kind = t[0]
        out.append(Shard(t[1]) if kind == "S" else Replicate() if kind == "R" else Partial(t[1]))
    return tuple(out)
