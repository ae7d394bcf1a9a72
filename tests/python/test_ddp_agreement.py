"""DDP and ZeRO-1/2/3 when the DP ranks' forwards differ: a layer that a data-dependent
branch skips on some ranks (an MoE expert, a layer skipped for some batches), also
where torch's reentrant checkpointing recomputes part of the model in a backward of its
own (nested in the user's), where some ranks' first gradient is produced.

Each step's single-device reference runs the same code on each DP rank's micro-batch
and averages the losses, so it takes the same branches. The parallel run must give the
same losses (rtol 1e-5), the same averaged gradients at every step (to 1e-5 of each
tensor's largest element, + 1e-6), ``grad None`` exactly where the reference has it (a
parameter unused on every rank, as torch's DDP leaves it), and after SGD with momentum
(which moves a parameter with a zero gradient, not one with none) the same parameters
on every rank. Small buckets (several per model) check that the ranks pair their
buckets' collectives right when their gradients arrive in different orders.

Buffers (BatchNorm's running statistics) are DP rank 0's on every rank at each forward,
as torch's DDP with ``broadcast_buffers=True`` keeps them."""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import vescale
from vescale import Replicate, Shard
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module

from dist_utils import full_grads, mesh, mismatch, mismatch_to_max

# per step, per DP rank: whether its micro-batch takes the branch (x.sum() > 0)
TAKEN = {
    4: [(True, False, False, False), (False, True, True, True), (False,) * 4, (True,) * 4, (False, False, True, False)],
    2: [(True, False), (False, True), (False, False), (True, True), (False, True)],
}
ROWS = 2  # per DP rank
LR, MOMENTUM = 0.1, 0.9

# layout -> (mesh name in dist_utils, its DP and TP dims; None: the whole mesh is DP)
MESHES = {"dp4": ("1d4", None, None), "dp2_tp2": ("2d", "DP", "TP")}
SMALL_BUCKETS_MB = 1e-4  # ~100 bytes: a few parameters per bucket

S0, S1 = Shard(0), Shard(1)
TP_PLAN = {  # up / b_up column-parallel, down / b_down row-parallel, the rest replicated
    "parameter": {r"(up|b_up)\.(weight|bias)": [S0], r"(down|b_down)\.weight": [S1]},
    "forward": {r"(up|b_up)\.input": [[Replicate()]], r"(down|b_down)\.output": [[Replicate()]]},
}


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.b_up = nn.Linear(6, 8)
        self.b_down = nn.Linear(8, 6)
        self.b_norm = nn.LayerNorm(6)
        self.never = nn.Linear(6, 6)  # unused on every rank, every step
        self.head = nn.Linear(6, 6)

    def trunk(self, x):
        return self.down(torch.relu(self.up(x)))

    def forward(self, x):
        h = self.trunk(x)
        if x.sum() > 0:  # this rank's data decides
            h = self.b_norm(h + self.b_down(torch.tanh(self.b_up(h))))
        return self.head(h).pow(2).mean()


class CheckpointedBranchy(Branchy):
    """Branchy whose trunk's second layer is recomputed by torch's reentrant checkpointing,
    with the head frozen: on a rank that skips the branch, backward's first gradient is the
    recomputed layer's, produced inside the checkpoint's own (nested) backward; on a rank
    that takes it, the branch's come first (set-up fuzzer, seed 157386: the ranks issued
    different collectives)."""

    def __init__(self):
        super().__init__()
        self.head.requires_grad_(False)

    def trunk(self, x):
        return checkpoint(lambda u: self.down(torch.relu(u)), self.up(x), use_reentrant=True)


MODELS = {"branchy": Branchy, "reentrant": CheckpointedBranchy}


def _micro_batch(step: int, dp_rank: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    x = torch.randn(ROWS, 6, generator=g).abs() + 0.1
    return x if TAKEN[dp][step][dp_rank] else -x


def _reference(dp: int, model_name: str = "branchy"):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads = [], []
    for step in range(len(TAKEN[dp])):
        opt.zero_grad()
        loss = sum(model(_micro_batch(step, r, dp)) for r in range(dp)) / dp
        loss.backward()
        losses.append(loss.item())
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model: DDP) -> dict:
    grads = full_grads(model)
    if model.reduce_scatter:  # ZeRO-2: a gradient no rank had has no slice (full_grads gives zeros)
        for name, p in model.module.named_parameters():
            if id(p) not in model.grad_shards:
                grads[name] = None
    return grads


def _case_train(mesh_name: str, zero: int, bucket_cap_mb: float, model_name: str = "branchy"):
    mesh_key, dp_dim, tp_dim = MESHES[mesh_name]
    m = mesh(mesh_key)
    dp_mesh = m[dp_dim] if dp_dim else m
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if tp_dim:
        parallelize_module(model, m[tp_dim], TP_PLAN)
    ddp = DDP(model, dp_mesh, bucket_cap_mb=bucket_cap_mb)
    if zero:
        opt = DistributedOptimizer(torch.optim.SGD, models=[ddp], zero_stage=zero, lr=LR, momentum=MOMENTUM)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    ref_losses, ref_grads, ref_params = _reference(dp, model_name)

    failures, collectives = [], []
    for step in range(len(TAKEN[dp])):
        opt.zero_grad()
        with vescale.debug.comm_trace() as trace:
            loss = ddp(_micro_batch(step, dp_rank, dp))  # (no buffers: no broadcast)
            loss.backward()
        collectives.append(collections.Counter(e["kind"] for e in trace.events if e["source"] in ("ddp", "zero")))
        value = (loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss).detach().clone()
        dist.all_reduce(value, group=dp_mesh.get_group())
        err = mismatch(value / dp, torch.tensor(ref_losses[step]), rtol=1e-5, atol=1e-6)
        if err:
            failures.append(f"step {step} loss: {err}")
        for name, p in model.named_parameters():
            if p.grad is not None and isinstance(p, vescale.DTensor) and p.grad.placements != p.placements:
                failures.append(f"step {step} {name}: gradient {p.grad.placements}, parameter {p.placements}")
        for name, g in _grads(ddp).items():
            err = mismatch_to_max(g, ref_grads[step][name], atol=1e-6)
            if err:
                failures.append(f"step {step} gradient of {name}: {err}")
        opt.step()
    with opt.full_parameters() if zero == 3 else contextlib.nullcontext():
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, vescale.DTensor) else p.detach()
            err = mismatch_to_max(full, ref_params[name], atol=1e-6)
            if err:
                failures.append(f"{name} after {len(TAKEN[dp])} steps: {err}")
    state = len(opt.state)  # SGD's momentum buffers: on every rank alike
    return failures, len(ddp.buckets), collectives, state


@pytest.mark.parametrize("bucket_cap_mb", [25.0, SMALL_BUCKETS_MB], ids=["one_bucket", "small_buckets"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_branch_skipped_on_some_ranks_matches_single_device(pool4, mesh_name, zero, bucket_cap_mb, model_name):
    results = pool4.run(_case_train, mesh_name, zero, bucket_cap_mb, model_name)
    for failures, _, _, _ in results:
        assert failures == []
    buckets = {r[1] for r in results}
    assert len(buckets) == 1
    if bucket_cap_mb == SMALL_BUCKETS_MB:
        assert buckets.pop() > 3
    # whether a rank had each gradient travels in the buckets' own collectives: one per
    # bucket and step, the same on every rank whichever branch its data took
    per_step = [r[2] for r in results]
    assert all(c == per_step[0] for c in per_step)
    # (ZeRO-3: one more after the first backward, which makes its held buckets the same everywhere)
    learned = [int(zero == 3 and step == 0) for step in range(len(per_step[0]))]
    assert [c["all_reduce"] + c["reduce_scatter"] for c in per_step[0]] == [results[0][1] + n for n in learned]
    assert len({r[3] for r in results}) == 1


def _case_never_used(zero: int):
    m = mesh("1d4")
    torch.manual_seed(0)
    model = Branchy()
    ddp = DDP(model, m, bucket_cap_mb=SMALL_BUCKETS_MB)
    options = dict(lr=LR, momentum=MOMENTUM, weight_decay=0.1)  # a zero gradient would move the parameter
    if zero:
        opt = DistributedOptimizer(torch.optim.SGD, models=[ddp], zero_stage=zero, **options)
    else:
        opt = torch.optim.SGD(model.parameters(), **options)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    ddp(-torch.ones(ROWS, 6)).backward()  # the branch is skipped on every rank
    unused = [n for n, p in model.named_parameters() if n.startswith(("b_", "never"))]
    have = [n for n in unused if model.get_parameter(n).grad is not None
            or id(model.get_parameter(n)) in ddp.grad_shards]
    opt.step()
    moved = [n for n in unused if not torch.equal(model.get_parameter(n).detach(), before[n])]
    return have, moved


@pytest.mark.parametrize("zero", [0, 1, 2], ids=["ddp", "zero1", "zero2"])
def test_parameter_unused_on_every_rank_keeps_no_gradient(pool4, zero):
    """As torch's DDP: no rank had a gradient, so none gets one and the step skips it."""
    for have, moved in pool4.run(_case_never_used, zero):
        assert have == []
        assert moved == []


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x)).pow(2).mean()


def _normed_batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dp_rank)
    return torch.randn(3, 4, generator=g) * (dp_rank + 1) + dp_rank


def _case_buffers(broadcast: bool):
    m, rank = mesh("1d4"), dist.get_rank()
    torch.manual_seed(0)
    model = Normed()
    ref = copy.deepcopy(model)
    ddp = DDP(model, m, broadcast_buffers=broadcast)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    failures, broadcasts = [], []
    for step in range(3):
        opt.zero_grad()
        with vescale.debug.comm_trace() as trace:
            loss = ddp(_normed_batch(step, rank))
        broadcasts.append(sum(e["kind"] == "broadcast" for e in trace.events))
        loss.backward()
        opt.step()
        # the reference: the average loss of the 4 micro-batches (BatchNorm in training
        # normalises by each batch's own statistics), and the running statistics of rank
        # 0's micro-batch alone, from rank 0's: what every rank starts the next forward with
        ref_opt.zero_grad()
        start = {n: b.clone() for n, b in ref.named_buffers()}
        others = sum(ref(_normed_batch(step, r)) for r in range(1, 4)) / 4
        others.backward()
        for n, b in ref.named_buffers():
            b.copy_(start[n])
        first = ref(_normed_batch(step, 0)) / 4
        first.backward()
        ref_loss = others + first
        ref_opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        err = mismatch(value / 4, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        if err:
            failures.append(f"step {step} loss: {err}")
    ddp.eval()
    ref.eval()
    probe = torch.randn(5, 4, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        ddp(probe)  # broadcasts rank 0's buffers (the last forward reduced), updates none in eval
        out = ddp.module.bn(ddp.module.lin(probe))
        expected = ref.bn(ref.lin(probe))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    gathered = [None] * 4
    dist.all_gather_object(gathered, buffers)
    same = all(torch.equal(g[n], buffers[n]) for g in gathered for n in buffers)
    if broadcast:
        for n, b in ref.named_buffers():
            err = mismatch(buffers[n], b, rtol=1e-5, atol=1e-6)
            if err:
                failures.append(f"buffer {n}: {err}")
        err = mismatch(out, expected, rtol=1e-5, atol=1e-6)
        if err:
            failures.append(f"eval output: {err}")
    return failures, broadcasts, same


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_buffers", "no_broadcast"])
def test_buffers_follow_rank_0_at_every_forward(pool4, broadcast):
    """BatchNorm's running statistics: rank 0's at every forward (one broadcast of all the
    buffers' bytes, float and int64 together), so eval outputs agree across ranks and
    with a single device that updated them with rank 0's micro-batches; with
    ``broadcast_buffers=False`` each rank keeps its own."""
    for failures, broadcasts, same in pool4.run(_case_buffers, broadcast):
        assert failures == []
        assert broadcasts == ([1, 1, 1] if broadcast else [0, 0, 0])
        assert same == broadcast


def _reductions(trace) -> int:
    """DDP's and ZeRO's gradient collectives in a comm_trace."""
    return sum(e["kind"] in ("all_reduce", "reduce_scatter") for e in trace.events if e["source"] in ("ddp", "zero"))


def _gradient_failures(ddp: DDP, ref: nn.Module, label: str = "") -> list[str]:
    """Where ``ddp``'s averaged gradients differ from one device's (``ref``'s ``.grad``)."""
    return [f"{label}gradient of {name}: {err}" for name, g in _grads(ddp).items()
            if (err := mismatch_to_max(g, ref.get_parameter(name).grad, atol=1e-6))]


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _penalized_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A WGAN-GP critic's loss: its mean output plus the penalty on the norm of its
    gradient with respect to the input, taken with ``torch.autograd.grad`` (a backward of
    its own, through the model's output, before the loss's)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + ((g.norm(dim=1) - 1) ** 2).mean()


def _case_gradient_penalty():
    m = mesh("1d4")
    torch.manual_seed(0)
    ref = Critic()
    ddp = DDP(copy.deepcopy(ref), m, bucket_cap_mb=SMALL_BUCKETS_MB)
    rank = m.get_local_rank()
    failures, reductions = [], []
    for step in range(2):
        xs = [torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(4)]
        ref.zero_grad()
        (sum(_penalized_loss(ref, x) for x in xs) / 4).backward()
        ddp.zero_grad()
        with vescale.debug.comm_trace() as trace:
            _penalized_loss(ddp, xs[rank]).backward()
        reductions.append(_reductions(trace))
        failures += _gradient_failures(ddp, ref, f"step {step} ")
    return failures, reductions, len(ddp.buckets)


def test_gradient_penalty_through_autograd_grad(pool4):
    """``torch.autograd.grad`` through the model's output (a gradient penalty) runs a
    backward of its own, which gives no parameter a gradient: DDP reduces nothing there,
    and the loss's backward then averages the gradients (double backward included) as
    one device, one collective per bucket."""
    for failures, reductions, buckets in pool4.run(_case_gradient_penalty):
        assert failures == []
        assert reductions == [buckets] * 2


class ReusedBlock(nn.Module):
    """One block applied twice, each application recomputed by torch's reentrant
    checkpointing in a backward of its own: the block's parameters get their gradient in
    two parts, in two backwards nested in the user's. ``late_reuse``: the block runs
    plainly once until ``reuse`` is set, then a second time, checkpointed."""

    def __init__(self, always_checkpointed: bool = True):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.always_checkpointed = always_checkpointed
        self.reuse = always_checkpointed

    def _block(self, u):
        return torch.tanh(self.block(u))

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self._block, h, use_reentrant=True) if self.always_checkpointed else self._block(h)
        h = self.other(h)
        if self.reuse:
            h = checkpoint(self._block, h, use_reentrant=True)
        return self.head(h).pow(2).mean()


def _case_reused_block(zero: int, bucket_cap_mb: float):
    m = mesh("1d4")
    torch.manual_seed(0)
    ref = ReusedBlock()
    ddp = DDP(copy.deepcopy(ref), m, bucket_cap_mb=bucket_cap_mb)
    if zero:
        opt = DistributedOptimizer(torch.optim.SGD, models=[ddp], zero_stage=zero, lr=LR, momentum=MOMENTUM)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    rank = m.get_local_rank()
    failures, reductions = [], []
    for step in range(3):
        xs = [torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(4)]
        ref_opt.zero_grad()
        (sum(ref(x) for x in xs) / 4).backward()
        opt.zero_grad()
        with vescale.debug.comm_trace() as trace:
            ddp(xs[rank]).backward()
        reductions.append(_reductions(trace))
        failures += _gradient_failures(ddp, ref, f"step {step} ")
        opt.step()
        ref_opt.step()
    return failures, reductions, len(ddp.buckets)


@pytest.mark.parametrize("bucket_cap_mb", [25.0, SMALL_BUCKETS_MB], ids=["one_bucket", "small_buckets"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["ddp", "zero1", "zero2", "zero3"])
def test_block_reused_under_reentrant_checkpointing_matches_single_device(pool4, zero, bucket_cap_mb):
    """A parameter accumulated in parts (each in a backward of its own) was counted as in
    each time: its bucket launched after the first part, and the other parameters of it,
    or the later parts, were lost (gradients off by up to 115%, or None). The first
    backward now launches every bucket at its end and learns which buckets get gradients
    in parts; those launch at the end of backward from then on, the others as before."""
    for failures, reductions, buckets in pool4.run(_case_reused_block, zero, bucket_cap_mb):
        assert failures == []
        assert reductions == [buckets + (zero == 3), buckets, buckets]


def _case_reuse_after_learning():
    m = mesh("1d4")
    torch.manual_seed(0)
    ref = ReusedBlock(always_checkpointed=False)
    ddp = DDP(copy.deepcopy(ref), m, bucket_cap_mb=SMALL_BUCKETS_MB)
    xs = [torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    x = xs[m.get_local_rank()]
    ddp(x).backward()  # the block once, plainly: its bucket launches as soon as its gradients are in
    ddp.zero_grad()
    ddp.module.reuse = ref.reuse = True
    try:
        ddp(x).backward()
    except RuntimeError as e:
        error = str(e)
    else:
        error = ""
    ddp.zero_grad()
    ddp(x).backward()  # run again: the block's bucket is held now
    (sum(ref(x) for x in xs) / 4).backward()
    return error, _gradient_failures(ddp, ref)


def test_gradient_in_parts_after_the_first_backward_raises(pool4):
    """A parameter whose gradient first comes in parts after the first backward (its
    bucket reduced before the later part came) is named in an error on every rank, with
    the way out, instead of a gradient that lacks a part; DDP carries on, and the step
    run again holds the bucket to the end of backward (one device's gradients)."""
    for error, failures in pool4.run(_case_reuse_after_learning):
        assert "block.weight" in error and "block.bias" in error, error
        assert "use_reentrant=False" in error, error
        assert failures == []
