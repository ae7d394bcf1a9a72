"""Ranks that see different data still issue the same collectives, against single-device
training of the same global batch (SGD, so that gradients and parameters are compared
tightly at every step; see dist_utils).

- ZeRO-3: a block's parameter that a data-dependent branch uses on some ranks' micro-
  batches only. A rank whose copy of it got no gradient once kept its unit whole after
  backward and skipped the next all-gather of it (the second micro-step of gradient
  accumulation, the next step's forward, ``full_parameters()``) that the other ranks
  issued: gathers paired with the wrong ones, then a gloo size abort.
- Pipeline: what crosses the stage boundary takes its shape from the data (the forward
  trims the padding to the micro-batch's longest sequence) while the inputs keep theirs;
  the shapes grow and shrink from step to step. The receiver once kept receiving into
  buffers of the first shape seen for those input shapes: a gloo abort when it grew,
  part of an uninitialised buffer when it shrank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import vescale
from vescale.parallel import DDP, DistributedOptimizer, PipelineParallel, parallelize_module

from dist_utils import full_grads, mismatch, mismatch_to_max

LR = 0.1
STEPS = 4
_meshes: dict = {}


def _mesh(shape, names) -> vescale.DeviceMesh:
    key = (tuple(shape), tuple(names))
    if key not in _meshes:
        n = 1
        for s in shape:
            n *= s
        _meshes[key] = vescale.DeviceMesh("cpu", torch.arange(n).reshape(shape), mesh_dim_names=names)
    return _meshes[key]


def _compare(losses, ref_losses, grads: list[dict], ref_grads: list[dict]) -> list[str]:
    """Every step's loss (rtol 1e-5) and every step's gradients (to 1e-5 of each tensor's
    largest element)."""
    failures = []
    err = mismatch(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    if err:
        failures.append(f"losses {losses} vs {ref_losses}: {err}")
    for step, (mine, ref) in enumerate(zip(grads, ref_grads)):
        for name, g in mine.items():
            err = mismatch_to_max(g, ref[name])
            if err:
                failures.append(f"step {step}, gradient of {name}: {err}")
    return failures


# ---- ZeRO-3: a parameter that some ranks do not use -----------------------------------------

class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, h, use_extra: bool):
        h = torch.tanh(self.lin(h))
        if use_extra:  # decided by the data: a micro-batch of another rank may differ
            h = h + self.extra(h)
        return h


class _Branchy(nn.Module):
    """Block i runs its ``extra`` layer when column i of the micro-batch sums above zero."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = x
        for i, block in enumerate(self.blocks):
            h = block(h, bool(x[:, i].sum() > 0))
        return F.mse_loss(self.head(h), y)


_TP_PLAN = {"parameter": {r"blocks\.\d+\.lin\.(weight|bias)": [vescale.Shard(0)],
                          r"blocks\.\d+\.extra\.weight": [vescale.Shard(1)]}}


def _branchy_data(chunks: int, branching: tuple[int, ...]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, ``chunks`` micro-batches of 2 samples: the sign of column i says whether
    block i's extra layer runs. Every step each block of ``branching`` runs it on some
    micro-batches and not on others (so some ranks' copies get no gradient in one
    micro-step or in both), and over the steps the ranks take turns; the other blocks
    always run it."""
    g = torch.Generator().manual_seed(11)
    steps = []
    for step in range(STEPS):
        mbs = []
        for c in range(chunks):
            x = torch.randn(2, 8, generator=g)
            for i in range(3):
                use = (c * 5 + i * 3 + step * 7) % 4 in (0, 3) or i not in branching
                x[:, i] = x[:, i].abs() * (1 if use else -1)
            mbs.append((x, torch.randn(2, 3, generator=g)))
        steps.append(mbs)
    return steps


def _accumulated_steps(model: nn.Module, steps) -> tuple[list, list]:
    """One device: per step, every part of its batch in turn (each loss over the number of
    parts), gradients accumulated, then SGD; the steps' losses and gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for parts in steps:
        opt.zero_grad()
        total = 0.0
        for x, y in parts:
            loss = model(x, y) / len(parts)
            loss.backward()
            total += loss.item()
        grads.append(full_grads(model))
        opt.step()
        losses.append(total)
    return losses, grads


def _branchy_reference(data):
    """One device, the same global batch: every micro-batch in turn, gradients accumulated."""
    torch.manual_seed(0)
    model = _Branchy()
    losses, grads = _accumulated_steps(model, data)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _case_zero3_unused_on_some_ranks(tp: bool, branching: tuple[int, ...]):
    m = _mesh((2, 2), ("DP", "TP")) if tp else _mesh((4,), ("DP",))
    dp = m["DP"] if tp else m
    dp_size, dp_rank = dp.size(), dp.get_local_rank()
    accumulate = 2
    data = _branchy_data(dp_size * accumulate, branching)
    torch.manual_seed(0)
    model = _Branchy()
    if tp:
        parallelize_module(model, m["TP"], _TP_PLAN)
    ddp = DDP(model, dp)
    opt = DistributedOptimizer(torch.optim.SGD, models=[ddp], zero_stage=3, lr=LR)
    losses, grads = [], []
    for mbs in data:
        opt.zero_grad()
        total = torch.zeros(())
        for micro in range(accumulate):
            x, y = mbs[dp_rank * accumulate + micro]
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                loss = ddp(x, y) / accumulate
                loss.backward()
            total += loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss.detach()
        dist.all_reduce(total, group=dp.get_group())
        losses.append(total.item() / dp_size)
        grads.append(full_grads(ddp))
        opt.step()
    ref_losses, ref_grads, ref_params = _branchy_reference(data)
    failures = _compare(losses, ref_losses, grads, ref_grads)
    with opt.full_parameters():  # one more gather of every unit, after the last backward
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, vescale.DTensor) else p.detach()
            err = mismatch_to_max(full, ref_params[name])
            if err:
                failures.append(f"parameter {name} after {STEPS} SGD steps: {err}")
    return failures


# Block 0's backward is the last one: its gradients' reduce-scatter comes after every
# all-gather of the backward, on every rank. Branching in later blocks also needs DDP to
# launch ZeRO-3's reduce-scatters at points every rank agrees on: launched when a unit's
# gradients are all in, a rank whose parameter got none launched it later, after
# all-gathers of the following units, which share the DP group (the collectives then
# paired up across ranks wrongly, or waited for each other). DDP now launches a unit's
# buckets at the latest when backward reaches the next unit, before its gather.
@pytest.mark.parametrize("branching", [
    (0,),
    (0, 1, 2),
], ids=["first_block", "every_block"])
@pytest.mark.parametrize("tp", [False, True], ids=["dp4", "dp2_tp2"])
def test_zero3_parameter_unused_on_some_ranks(pool4, tp, branching):
    for failures in pool4.run(_case_zero3_unused_on_some_ranks, tp, branching):
        assert failures == []


# ---- pipeline: a boundary whose shape follows the data ----------------------------------------

PAD = 0
SEQ = 12
LONGEST = [9, 5, 11, 3, 6]  # per step: shrinks, grows past the first, shrinks, grows


class _Trimmed(nn.Module):
    """Token ids padded at the end with PAD; the forward cuts the batch to its longest
    sequence, so the activations crossing a stage boundary are [batch, longest, 16]
    while the inputs stay [batch, SEQ]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(16, 32)

    def forward(self, x, y):
        longest = int((x != PAD).sum(1).max())
        x, y = x[:, :longest], y[:, :longest]
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), ignore_index=PAD)


def _trimmed_batches(batch: int = 8):
    """Every micro-batch (2 samples or more, consecutive) of step i is LONGEST[i] long."""
    g = torch.Generator().manual_seed(5)
    out = []
    for longest in LONGEST:
        x = torch.randint(1, 32, (batch, SEQ), generator=g)
        y = torch.randint(1, 32, (batch, SEQ), generator=g)
        for j in range(batch):
            n = longest - j % 2
            x[j, n:] = PAD
            y[j, n:] = PAD
        out.append((x, y))
    return out


def _case_pipeline_data_dependent_shapes(shape, names, schedule: str, zero: int | None):
    m = _mesh(shape, names)
    if dist.get_rank() >= m.size():
        return []  # not part of this mesh
    microbatches = 2
    dp = m.size("DP") if "DP" in names else 1
    dp_rank = m.get_local_rank("DP") if "DP" in names else 0
    batches = _trimmed_batches()
    torch.manual_seed(0)
    model = _Trimmed()
    pipe = PipelineParallel(model, m, split="uniform", schedule=schedule, microbatches=microbatches)
    wrapped = DDP(pipe, m["DP"]) if dp > 1 else pipe
    if zero is not None:
        opt = DistributedOptimizer(torch.optim.SGD, [wrapped], zero_stage=zero, lr=LR)
    else:
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, grads = [], []
    for x, y in batches:
        x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        opt.zero_grad()
        loss = pipe.step(x, y).detach().double()
        if dp > 1:  # the batch loss: the mean of the DP ranks' losses
            dist.all_reduce(loss, group=m.get_group("DP"))
            loss /= dp
        losses.append(loss.item())
        grads.append(full_grads(wrapped))
        opt.step()

    # one device: the same micro-batches (each trimmed to its own longest sequence), the
    # batch's loss their mean
    torch.manual_seed(0)
    ref_losses, ref_grads = _accumulated_steps(_Trimmed(), [
        [(xa, ya) for xd, yd in zip(x.chunk(dp), y.chunk(dp))
         for xa, ya in zip(xd.tensor_split(microbatches), yd.tensor_split(microbatches))]
        for x, y in batches])
    failures = _compare(losses, ref_losses, grads, ref_grads)
    # one header per shape crossing the boundary, then payloads only
    if pipe.local_stages == [0] and pipe.boundary.headers_sent != len(set(LONGEST)):
        failures.append(f"{pipe.boundary.headers_sent} headers sent for {len(set(LONGEST))} boundary shapes")
    return failures


PIPELINE_CASES = {
    "pp2-1f1b": ((2,), ("PP",), "1f1b", None),
    "pp2-dp2-1f1b": ((2, 2), ("PP", "DP"), "1f1b", None),
    # the split backward (input, then weight halves) under ZeRO-3
    "pp2-dp2-zb_h1-zero3": ((2, 2), ("PP", "DP"), "zb_h1", 3),
}


@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_pipeline_boundary_shape_follows_the_data(pool4, name):
    for failures in pool4.run(_case_pipeline_data_dependent_shapes, *PIPELINE_CASES[name]):
        assert failures == []
