"""The loss over the DP ranks' batches as one device's loss over the global batch.

Each DP rank computes its model's loss on its own rows. One device's loss is a mean over
the whole global batch, so each rank's loss is weighted by its share of what that mean
divides by:

- where the loss is itself a mean-reduced ``F.cross_entropy`` / ``F.nll_loss`` (its
  autograd node is ``NllLossBackward0``), by the divisor that node saved
  (``total_weight``: the targets not ignored, or the sum of their class weights). Batches
  with ``ignore_index`` targets (padding, a prompt's tokens in supervised fine-tuning)
  hold different numbers of targets on each rank, and a mean of the ranks' means would
  weigh a rank's target by how few its batch held;
  Under ``torch.no_grad()`` (an evaluation loop) there is no node: while the forward
  runs, a watch in the engine (``dispatch/loss_watch.cpp``, ``items_seen``) keeps what
  each mean cross-entropy divided by, and the loss the model returns is looked up there;
- otherwise (another loss) by the batch's rows (dim 0 of its first tensor), as the last,
  smaller batch of a ``drop_last=False`` loader needs (a rank may have none).

Ranks agree on which (every rank must have such a loss for the item weighting), in the one
all-reduce that also sums the losses. The same all-reduce tells the others when a rank's
forward raised (``DPLoss.tell_others``), so that they raise too instead of waiting for it.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from . import _C
from .dtensor import DTensor
from .placement_types import Replicate

__all__ = ["DPLoss", "rows_of", "items_averaged", "items_seen"]

_MEAN = 1  # torch's Reduction::Mean
_NLL_NODES = ("NllLossBackward0", "NllLoss2DBackward0")
# The all-reduced vector: loss x rows, rows, loss x items, items, ranks that counted items,
# then (where the ranks can agree on a failed forward) one slot per DP rank.
_LOSS_ROWS, _ROWS, _LOSS_ITEMS, _ITEMS, _COUNTED, _FAILED = range(6)
_RAISED, _RAISED_EMPTY = 1.0, 2.0


def rows_of(args: tuple, kwargs: dict) -> int:
    """The batch's rows on this rank: dim 0 of its first tensor that has dims (1 where it
    has none: every rank then weighs the same)."""
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.shape[0]
    return 1


def items_averaged(loss: torch.Tensor, seen: Callable | None = None) -> torch.Tensor | None:
    """What ``loss`` divides by, where it is a mean-reduced cross-entropy / NLL loss: its
    autograd node saved it, or without autograd ``seen`` (``items_seen``) did; None for
    any other loss."""
    node = loss.grad_fn
    if node is not None:
        if node.name() not in _NLL_NODES or node._saved_reduction != _MEAN:
            return None
        total = node._saved_total_weight
    else:
        total = seen(loss) if seen is not None else None
        if total is None:
            return None
    return (total.full_tensor() if isinstance(total, DTensor) else total).detach()


@contextlib.contextmanager
def items_seen(on: bool):
    """While the block runs (a forward without autograd), the engine keeps what each mean
    cross-entropy on this thread divides by; yields the lookup ``items_averaged`` takes
    (None when ``on`` is false: nothing is watched, no op pays for it)."""
    if not on:
        yield None
        return
    _C.loss_watch_start()
    try:
        yield _C.loss_watch_total
    finally:
        _C.loss_watch_stop()


class _GlobalLoss(torch.autograd.Function):
    """``value`` (the global loss, the same bits on every rank) forward, and this rank's
    loss's gradient times ``weight`` (its share of the global divisor, relative to an even
    share) backward. Adding ``mean - mine`` to the loss instead rounded differently on
    each rank (a Partial loss's sum rounds once per TP rank: DP rows an ulp apart, in fp32
    too), and ranks that log, or branch on, the loss drift apart."""

    @staticmethod
    def forward(ctx, loss, value, weight):
        ctx.weight = weight
        if isinstance(loss, DTensor):
            return DTensor.from_local(value, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
        return value.clone()

    @staticmethod
    def backward(ctx, g):  # an even share's weight is exactly 1
        return g * ctx.weight.to(g.dtype), None, None


class DPLoss:
    """Makes a rank's loss the global one over a DP group (``size`` ranks, this one
    ``rank``). ``can_agree``: whether a rank whose forward raised may tell the others in
    the loss's all-reduce (they must reach it next on the group)."""

    def __init__(self, group, size: int, rank: int, can_agree: bool):
        self.group, self.size, self.rank, self.can_agree = group, size, rank, can_agree

    def __call__(self, loss: torch.Tensor, rows: int, items: torch.Tensor | None) -> torch.Tensor:
        """The global loss (see the module docstring). ``items``: ``items_averaged`` of
        the loss as the model returned it (None: weigh by ``rows``). A rank without rows
        or items has a NaN loss (a mean over nothing): it counts for nothing."""
        mine = loss.detach()
        mine = mine.full_tensor() if isinstance(mine, DTensor) else mine
        sums = self._sums(mine.device, rows)
        if rows:
            sums[_LOSS_ROWS] = mine.double() * rows
        if items is not None:
            items = items.to(sums)
            sums[_LOSS_ITEMS] = torch.where(items > 0, mine.double() * items, 0.0)
            sums[_ITEMS], sums[_COUNTED] = items, 1.0
        dist.all_reduce(sums, group=self.group)
        if self.can_agree and bool(sums[_FAILED:].any()):
            raise RuntimeError(self._failed_elsewhere(sums[_FAILED:]))
        # tensors throughout: no wait for the device here
        by_items = sums[_COUNTED] == self.size
        share = torch.where(by_items, items if items is not None else 0.0, float(rows))
        total = torch.where(by_items, sums[_ITEMS], sums[_ROWS])
        value = torch.where(by_items, sums[_LOSS_ITEMS], sums[_LOSS_ROWS]) / total
        return _GlobalLoss.apply(loss, value.to(mine.dtype), share * self.size / total)

    def tell_others(self, error: Exception, rows: int, returns_loss: bool | None) -> None:
        """This rank's forward raised: where the others can be told (they would reach the
        loss's all-reduce next: ``can_agree``, and the model returns a loss or has not
        been called yet), they are; they raise too instead of waiting for this rank. The
        error says so; on an empty batch it names the likely cause."""
        if rows == 0:
            error.add_note(f"vescale: this rank's batch has no rows (DP rank {self.rank} of {self.size}): a "
                           f"drop_last=False loader splits its last, smaller global batch over the DP ranks, and it "
                           f"had fewer samples than DP ranks; this model cannot take an empty batch. Use "
                           f"data.drop_last=True (DataLoader(drop_last=True)), or a dataset whose size leaves a last "
                           f"batch of at least {self.size} samples")
        if not self.can_agree or returns_loss is False:
            return
        sums = self._sums(torch.device("cpu"), 0)
        sums[_FAILED + self.rank] = _RAISED_EMPTY if rows == 0 else _RAISED
        dist.all_reduce(sums, group=self.group)
        error.add_note("vescale: the other DP ranks were told, and raise too")

    def _sums(self, device, rows: int) -> torch.Tensor:
        sums = torch.zeros(_FAILED + (self.size if self.can_agree else 0), dtype=torch.float64, device=device)
        sums[_ROWS] = rows
        return sums

    def _failed_elsewhere(self, slots: torch.Tensor) -> str:
        failed = slots.nonzero().flatten().tolist()
        empty = [r for r in failed if slots[r] == _RAISED_EMPTY]
        why = (f"; ranks {empty} had an empty batch (drop_last=False's last global batch had fewer samples than DP "
               f"ranks): use data.drop_last=True" if empty else "")
        return (f"the model's forward raised on DP rank(s) {failed} of {self.size} (their errors say why){why}; "
                f"this rank stops this step too instead of waiting for them. Nothing was reduced: the step can be "
                f"taken again with another batch")
