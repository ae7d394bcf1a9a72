"""The global gradient norm over every rank, as ``torch.nn.utils.clip_grad_norm_`` computes
it on one device: p-norms from each rank's sum of ``|g| ** p`` (elements several ranks
hold counted once), the inf norm from each rank's largest ``|g|`` (a NaN anywhere makes it
NaN, as on one device: the ranks' maxima are combined with a NaN flag beside them, since
the backends' max drops a NaN by the order the ranks meet)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import _trace

__all__ = ["NormOverRanks", "checked_norm_type"]


def checked_norm_type(norm_type) -> float:
    p = float(norm_type)
    if not p > 0:  # (NaN included)
        raise ValueError(f"norm_type {norm_type!r} is not supported for a gradient norm over ranks: use a positive "
                         f"p (2.0, 1.0, ...) or float('inf')")
    return p


class NormOverRanks:
    """Adds this rank's gradient parts, then ``over_ranks()`` combines every rank's."""

    def __init__(self, norm_type, device):
        self.p = checked_norm_type(norm_type)
        self.inf = math.isinf(self.p)
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, g: torch.Tensor, copies: float = 1.0) -> None:
        """A local gradient tensor whose elements ``copies`` ranks hold alike."""
        a = g.detach().double().abs()
        if self.inf:
            if a.numel():
                self.total = torch.maximum(self.total, a.amax())  # (a NaN stays)
        else:
            self.total += a.pow(self.p).sum() / copies

    def over_ranks(self, source: str | None = None) -> torch.Tensor:
        """The norm over every rank (a collective over the world; ``source`` names it in
        the communication trace)."""
        if not dist.is_initialized():
            return self.total if self.inf else self.total.pow(1.0 / self.p)
        if self.inf:
            nan = self.total.isnan()
            sent = torch.stack([torch.where(nan, 0.0, self.total), nan.double()])
            _reduce(sent, dist.ReduceOp.MAX, source)
            return torch.where(sent[1] > 0, float("nan"), sent[0])
        _reduce(self.total, dist.ReduceOp.SUM, source)
        return self.total.pow(1.0 / self.p)


def _reduce(t: torch.Tensor, op, source: str | None) -> None:
    if source is None:
        dist.all_reduce(t, op=op)
    else:
        _trace.call("all_reduce", None, t, dist.all_reduce, t, op=op, source=source)
