"""How a pipeline step weighs its micro-batches' losses: as one device's loss over the batch.

By rows (a micro-batch's share of the batch's samples) unless the loss is a mean-reduced
cross-entropy (``global_loss.items_averaged``): then by the targets it averages over, so
that masked targets (padding, a prompt's tokens) weigh as on one device. Their total over
the batch (and the DP replicas) is known only after the last forward, while a schedule
runs the first micro-batch's backward long before. So each micro-batch's backward starts
from loss x items x c, with c a constant of this replica (chosen at its first micro-batch
so that the first root equals its rows weight: fp16 magnitudes stay as they were), and
once the schedule is over the step's gradients are multiplied by DP / (c x total items):
a linear rescaling, exact up to rounding. Gradients accumulated by earlier steps are set
aside meanwhile. ZeRO-2/3 alike: the schedule runs under ``no_sync``, so the step's
gradients are whole in ``.grad`` until the reduce-scatter after the rescaling.
The estimate c differs from one device's 1 / (total items) where the first micro-batch
masks more or less than the batch: exact in fp32 and bf16 up to rounding, but an fp16
loss scale can overflow at another step than one device's.
An evaluation weighs alike (its forwards run with autograd on, so the loss's node says
what it averages over), ZeRO-3 included: it has no gradients to rescale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..._local import local_of
from ...dtensor import DTensor
from ...global_loss import items_averaged

# the vector the last stage sends over the pipeline after a step (the others add their
# thawed parameters: see PipelineParallel.step)
_BY_ROWS, _LOSS_ITEMS, _ITEMS, _C, _COUNTED, _THAWED = range(6)


class StepWeights:
    """One step's (or evaluation's) weighting of its micro-batches."""

    def __init__(self):
        self.items_mode: bool | None = None  # decided at the last stage's first micro-batch
        self.c: torch.Tensor | None = None
        self.global_loss: torch.Tensor | None = None  # over the DP replicas, in items mode
        self._aside: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self.thawed = 0  # over the pipeline's ranks (batch_loss)

    def root(self, loss: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's loss weighted (in its dtype, as ``loss * weight`` is: by rows,
        an fp16 loss scale overflows where one device's does; by items, see the module
        docstring), and its items (or None)."""
        items = items_averaged(loss)
        if self.items_mode is None:
            self.items_mode = items is not None
            if items is not None:
                self.c = weight / items.double().clamp(min=1)
        elif self.items_mode != (items is not None):
            raise RuntimeError("the pipeline's micro-batch losses are of different kinds (a mean cross-entropy for "
                               "some, another loss for others): their weights cannot be chosen alike")
        if items is None:
            return loss * weight, None
        return (loss.double() * (items * self.c)).to(loss.dtype), items

    def set_aside(self, params, keep: set[int]) -> None:
        """Gradients of earlier steps (accumulation under ``no_sync``) out of the way of this
        step's rescaling; ``keep``: ids of parameters handled elsewhere (shared ones)."""
        for p in params:
            if p.grad is not None and id(p) not in keep:
                self._aside[id(p)] = (p, p.grad)
                p.grad = None

    def batch_loss(self, losses: list, group, last: int, thawed: int = 0) -> torch.Tensor:
        """The replica's batch loss on every pipeline rank (``losses``: the last stage's
        (loss, weight, items)); learns the replica's weighting from the last stage, and
        the count of ``thawed`` parameters over the pipeline's ranks (``self.thawed``)."""
        vec = torch.zeros(6, dtype=torch.float64)
        for loss, weight, items in losses:
            value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).double().cpu()
            vec[_BY_ROWS] += value * weight
            if items is not None:
                items = items.double().cpu()
                vec[_LOSS_ITEMS] += torch.where(items > 0, value * items, 0.0)
                vec[_ITEMS] += items
        if self.items_mode:
            vec[_C], vec[_COUNTED] = self.c.cpu(), 1.0
        vec[_THAWED] = thawed
        # a sum: the last stage's values (the others send zeros there, exact), and every
        # rank's thawed count, in one collective
        dist.all_reduce(vec, group=group)
        self.thawed = int(vec[_THAWED])
        self.items_mode = bool(vec[_COUNTED])
        if self.items_mode:
            self.c = vec[_C]
            self._vec = vec
            return vec[_LOSS_ITEMS] / vec[_ITEMS]
        return vec[_BY_ROWS]

    def over_replicas(self, dp_group) -> torch.Tensor | None:
        """Items mode: the loss over every DP replica's items (``global_loss``), and their
        total; None otherwise. (An evaluation stops here: it has no gradients to rescale.)"""
        if not self.items_mode:
            return None
        sums = self._vec[[_LOSS_ITEMS, _ITEMS]].clone()
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        self.global_loss = sums[0] / sums[1]
        return sums[1]

    def rescale(self, params, dp_group, dp_size: int) -> None:
        """Items mode: this step's gradients times DP / (c x the items of every replica);
        then the gradients set aside come back."""
        items = self.over_replicas(dp_group)
        if items is not None:
            # all targets ignored everywhere: one device's gradients are 0 (and its loss NaN)
            factor = float(dp_size / (self.c * items)) if items > 0 else 0.0
            for p in params:
                if p.grad is not None:
                    local_of(p.grad).mul_(factor)  # (every placement's local part scales alike)
        for p, earlier in self._aside.values():
            p.grad = earlier if p.grad is None else p.grad + earlier
        self._aside = {}
