"""Gradient clipping over every mesh dim, mixed precision with fp32 master weights,
fp16 loss scaling that skips overflowing steps on every rank, several models with
their own meshes in one program, and parallelize_module's errors."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale import Replicate, Shard
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.plans import gpt_plan, llama_plan

from dist_utils import adam_mismatch, mesh, mismatch, mismatch_to_max
from test_parallel import _batches
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM

CLIP = 0.05  # small enough that every step clips


def _reference(factory, steps=3, clip=None, dtype=torch.float32, autocast=False):
    torch.manual_seed(0)
    model = factory().to(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    losses = []
    for idx, tgt in _batches()[:steps]:
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx, tgt)
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        losses.append(loss.float().item())
    return losses


def _train_dp2_tp2(factory, plan, *, steps=3, clip=None, zero=0, dtype=torch.float32, autocast=False,
                   loss_scale=None, clip_with="optimizer"):
    m = mesh("2d")
    torch.manual_seed(0)
    model = factory().to(dtype)
    parallelize_module(model, m["TP"], plan(sequence_parallel=True))
    model = DDP(model, m["DP"])
    if zero:
        opt = DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=zero, lr=1e-2, loss_scale=loss_scale)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank, losses = m.get_local_rank("DP"), []
    for idx, tgt in _batches()[:steps]:
        opt.zero_grad()
        rows = slice(2 * dp_rank, 2 * dp_rank + 2)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx[rows], tgt[rows])
        (opt.scale_loss(loss) if loss_scale else loss).backward()
        if clip and zero and clip_with == "optimizer":
            opt.clip_grad_norm_(clip)
        elif clip:  # ZeRO-2/3: routed to the optimizer's (vescale/parallel/torch_clip.py)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        value = loss.full_tensor().float()
        dist.all_reduce(value, group=m["DP"].get_group())
        losses.append(value.item() / 2)
    return losses


def _case_clip(zero: int, loss_scale=None, clip_with="optimizer"):
    factory = lambda: LlamaForCausalLM(LlamaConfig())  # noqa: E731
    losses = _train_dp2_tp2(factory, llama_plan, clip=CLIP, zero=zero, loss_scale=loss_scale, clip_with=clip_with)
    ref = _reference(factory, clip=CLIP)
    return mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)


# With a loss scale the gradients are still scaled when the loop clips: the optimizer's
# clip divides its norm by the scale (before, it clipped by a norm 1024 times too large).
@pytest.mark.parametrize("zero,loss_scale,clip_with", [(0, None, "torch"), (2, None, "optimizer"),
                                                       (2, 1024.0, "optimizer"), (3, 1024.0, "torch")])
def test_clip_grad_norm_over_all_mesh_dims(pool4, zero, loss_scale, clip_with):
    assert pool4.run(_case_clip, zero, loss_scale, clip_with) == [None] * 4


def _case_norm_types(zero: int) -> list[str]:
    """The global gradient norm for p = 2, 1 and inf against one device's
    (``torch.nn.utils.get_total_norm``): DDP over DP2 x TP2 with sequence parallelism,
    through ZeRO's ``clip_grad_norm_`` (zero > 0) or the plain parameters' ``grad_norm``
    (what ``vescale.parallelize``'s optimizer uses without ZeRO). Then a NaN in one rank's
    shard of one gradient: one device's norms are NaN, every rank's must be too (the inf
    norm once took the p-th power, inf, of every element; then the ranks' maxima dropped
    the NaN)."""
    from vescale.parallel.optimizer import grad_norm

    m = mesh("2d")
    factory = lambda: LlamaForCausalLM(LlamaConfig())  # noqa: E731
    idx, tgt = _batches()[0]
    torch.manual_seed(0)
    ref = factory()
    ref(idx, tgt).backward()
    torch.manual_seed(0)
    model = factory()
    parallelize_module(model, m["TP"], llama_plan(sequence_parallel=True))
    model = DDP(model, m["DP"])
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=zero, lr=0.1) if zero else None
    rows = slice(2 * m.get_local_rank("DP"), 2 * m.get_local_rank("DP") + 2)
    model(idx[rows], tgt[rows]).backward()

    def norm(p: float) -> torch.Tensor:
        if opt is not None:
            return opt.clip_grad_norm_(1e9, p)
        return grad_norm(list(model.parameters()), p, ranks_per_stage=4)

    failures = []
    for p in (2.0, 1.0, float("inf")):
        want = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()], p)
        err = mismatch(norm(p).double(), want.double(), rtol=1e-5, atol=0)
        if err:
            failures.append(f"norm_type {p}: {err}")
    grads = opt.owned if opt is not None else None
    if dist.get_rank() == 3:  # one element of this rank's part of one gradient
        target = grads[0].param if grads is not None else next(model.parameters())
        slot = opt._grad_slice(grads[0]) if grads is not None else (target.grad.to_local()
                                                                    if isinstance(target.grad, vescale.DTensor)
                                                                    else target.grad)
        slot.view(-1)[-1] = float("nan")
    for p in (2.0, float("inf")):
        if not torch.isnan(norm(p)):
            failures.append(f"norm_type {p} with a NaN on rank 3 is not NaN")
    with pytest.raises(ValueError, match="norm_type 0"):
        norm(0)
    return failures


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradient_norms_of_every_type_over_all_mesh_dims(pool4, zero):
    assert pool4.run(_case_norm_types, zero) == [[]] * 4


def _case_bf16():
    factory = lambda: GPT(GPTConfig(bias=False))  # noqa: E731
    losses = _train_dp2_tp2(factory, gpt_plan, zero=2, dtype=torch.bfloat16)
    ref = _reference(factory, dtype=torch.bfloat16)
    # bf16 keeps 8 bits of mantissa: sums in another order differ in the 3rd digit
    return mismatch(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=1e-2)


def test_bf16_with_fp32_master_weights(pool4):
    assert pool4.run(_case_bf16) == [None] * 4


def _case_autocast(model: str):
    """fp32 parameters under bf16 autocast: autocast casts the DTensors themselves, so
    autograd records the casts (before the fix it skipped DTensor ops, their local ops
    ran in bf16 anyway, and backward met mixed dtypes)."""
    factory = ((lambda: GPT(GPTConfig(bias=False))) if model == "gpt"  # noqa: E731
               else (lambda: LlamaForCausalLM(LlamaConfig())))
    plan = gpt_plan if model == "gpt" else llama_plan
    losses = _train_dp2_tp2(factory, plan, zero=2, autocast=True)
    ref = _reference(factory, autocast=True)
    fp32 = _reference(factory)
    m = mesh("2d")
    torch.manual_seed(0)
    net = factory()
    parallelize_module(net, m["TP"], plan(sequence_parallel=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(_batches()[0][0])
    logits = getattr(logits, "logits", logits)
    problems = [mismatch(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=1e-2),
                None if logits.dtype == torch.bfloat16 else f"logits in {logits.dtype}",
                # autocast really ran in bf16: the fp32 run's losses differ beyond fp32 rounding
                None if max(abs(a - b) for a, b in zip(losses, fp32)) > 1e-5 else "losses equal the fp32 run's"]
    return [p for p in problems if p]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_bf16_autocast_with_fp32_parameters(pool4, model):
    assert pool4.run(_case_autocast, model) == [[]] * 4


def _case_loss_scaling():
    m = mesh("1d4")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 8), m)
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=2, loss_scale="dynamic", lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    for step in range(2):
        opt.zero_grad()
        opt.scale_loss(model(x).pow(2).mean()).backward()
        if step == 1 and dist.get_rank() == 2:
            # an overflow on one rank's gradient slice only
            next(iter(model.grad_shards.values())).fill_(float("inf"))
        before = [p.detach().clone() for p in model.parameters()]
        scale = opt.scaler.scale
        opt.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        out[step] = (changed, opt.scaler.scale / scale)
    return out


def test_fp16_loss_scaling_skips_on_every_rank(pool4):
    for res in pool4.run(_case_loss_scaling):
        assert res[0] == (True, 1.0)   # a clean step updates and keeps the scale
        assert res[1] == (False, 0.5)  # one rank's overflow: nobody updates, the scale halves


def _case_fixed_scale_overflow():
    m = mesh("1d4")
    model = DDP(torch.nn.Linear(8, 8), m)
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=1, loss_scale=1024.0, lr=0.1)
    opt.scale_loss(model(torch.ones(2, 8)).sum()).backward()
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return (all(torch.equal(b, p) for b, p in zip(before, model.parameters())), opt.scaler.scale,
            [str(w.message) for w in caught])


def test_a_fixed_loss_scale_that_overflows_says_so(pool4):
    for unchanged, scale, messages in pool4.run(_case_fixed_scale_overflow):
        assert unchanged and scale == 1024.0
        assert any("fixed loss_scale 1024 skipped this step" in m for m in messages), messages


def _case_fp16_average_does_not_overflow(reduce_scatter: bool):
    """Every rank's fp16 gradient is 30,000: their sum (120,000) is past fp16's 65,504,
    their average is not. DDP divides before it sums, as torch's DDP does."""
    m = mesh("1d4")
    layer = torch.nn.Linear(1, 4, bias=False).half()
    model = DDP(layer, m, reduce_scatter=reduce_scatter)
    (model(torch.ones(1, 1, dtype=torch.float16)) * 30000).sum().backward()
    grad = next(iter(model.grad_shards.values())) if reduce_scatter else layer.weight.grad
    return grad.float().tolist()


@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_fp16_gradient_average_does_not_overflow_in_the_sum(pool4, reduce_scatter):
    for grad in pool4.run(_case_fp16_average_does_not_overflow, reduce_scatter):
        flat = torch.tensor(grad).flatten()
        assert flat.numel() >= 1 and torch.equal(flat, torch.full_like(flat, 30000.0)), grad


def _case_torch_grad_scaler(stage: int) -> list[str]:
    """torch.amp.GradScaler over a ZeRO optimizer: refused at step() with the fix named
    (its inf check read .grad, which ZeRO's masters do not hold: it raised torch's own
    "No inf checks were recorded"), the parameters untouched; the same optimizer then
    steps as usual."""
    m = mesh("1d4")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), m)
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=stage, lr=0.1)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    with opt.full_parameters():
        before = [p.detach().clone() for p in model.parameters()]
    scaler, problems = torch.amp.GradScaler("cpu", init_scale=1024.0), []
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.unscale_(opt)  # the AMP recipe before clipping: nothing to unscale here, no error yet
    try:
        scaler.step(opt)
        problems.append("GradScaler.step did not raise")
    except RuntimeError as e:
        if "loss_scale='dynamic'" not in str(e) or "Nothing was stepped" not in str(e):
            problems.append(f"unclear error: {e}")
    with opt.full_parameters():
        if any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
            problems.append("the refused step changed the parameters")
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # usable after the refusal
    with opt.full_parameters():
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            problems.append("the next step changed nothing")
    return problems


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_grad_scaler_over_zero_is_refused_with_the_fix(pool4, stage):
    assert pool4.run(_case_torch_grad_scaler, stage) == [[]] * 4


def _case_loss_scaling_backpropagates_shares(stage: int):
    """fp16 loss scaling over DP4 at a fixed scale of 2^15: the gradient at the hidden
    layer is 2^15 / 8 x 8 = 32,768 per sample on one device (the mean of 8 samples); a
    rank's mean of its own 2 would make it 4 times that, past fp16's 65,504, and skip a
    step one device takes. ``scale_loss`` starts every rank's backward from its share."""
    m = mesh("1d4")

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 1, bias=False)).half()
        with torch.no_grad():
            model[0].weight.fill_(0.01)
            model[1].weight.fill_(8.0)
        return model

    x = torch.full((8, 4), 0.01, dtype=torch.float16)
    x[:, 0] = torch.arange(8, dtype=torch.float16) / 100  # samples differ
    one = build()
    (one(x).mean() * 2.0**15).backward()
    want = [p.grad.float() / 2.0**15 for p in one.parameters()]
    assert all(torch.isfinite(w).all() for w in want)
    model = DDP(build(), m)
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=stage, loss_scale=2.0**15, lr=0.1)
    mine = x.chunk(4)[dist.get_rank()]
    opt.scale_loss(model(mine).mean()).backward()
    # ZeRO-1 all-reduces whole gradients (still scaled): one device's, to fp16's rounding
    got = [p.grad.float() / 2.0**15 for p in model.parameters()] if stage == 1 else want
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # warns if an inf skipped it
    return [mismatch(g, w, rtol=1e-2, atol=1e-7) for g, w in zip(got, want)], [str(w.message) for w in caught]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_loss_scaling_backpropagates_each_ranks_share(pool4, stage):
    for mismatches, warned in pool4.run(_case_loss_scaling_backpropagates_shares, stage):
        assert warned == [] and mismatches == [None, None], (warned, mismatches)


def _case_two_models():
    """An actor on a 2-way TP mesh inside the 2x2 mesh and a critic on the 4-way mesh,
    trained alternately in one program."""
    actor_mesh, critic_mesh = mesh("2d")["TP"], mesh("1d4")
    torch.manual_seed(0)
    actor = parallelize_module(GPT(GPTConfig(bias=False)), actor_mesh, gpt_plan())
    torch.manual_seed(1)
    critic = parallelize_module(LlamaForCausalLM(LlamaConfig()), critic_mesh, llama_plan(sequence_parallel=True))
    opts = [torch.optim.AdamW(actor.parameters(), lr=1e-2), torch.optim.AdamW(critic.parameters(), lr=1e-2)]
    torch.manual_seed(0)
    ref_actor = GPT(GPTConfig(bias=False))
    torch.manual_seed(1)
    ref_critic = LlamaForCausalLM(LlamaConfig())
    ref_opts = [torch.optim.AdamW(ref_actor.parameters(), lr=1e-2), torch.optim.AdamW(ref_critic.parameters(), lr=1e-2)]
    losses, ref_losses = [], []
    for idx, tgt in _batches()[:3]:
        for models, optims, out in (((actor, critic), opts, losses), ((ref_actor, ref_critic), ref_opts, ref_losses)):
            for model, opt in zip(models, optims):
                opt.zero_grad()
                loss = model(idx, tgt)
                loss.backward()
                opt.step()
                out.append(loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item())
    return mismatch(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_two_models_with_their_own_meshes(pool4):
    assert pool4.run(_case_two_models) == [None] * 4


def _case_plan_errors():
    m = mesh("1d4")
    errors = {}
    for name, plan in {
        "unmatched": {"parameter": {r"h\.\d+\.nope\.weight": [Shard(0)]}},
        "out of range": {"parameter": {r"lm_head\.weight": [Shard(2)]}},
        "wrong arity": {"parameter": {r"lm_head\.weight": [Shard(0), Replicate()]}},
        "bad forward key": {"forward": {r"transformer\.ln_f": [[Replicate()]]}},
        "forward matches nothing": {"forward": {r"nope\.input": [[Replicate()]]}},
        "tied conflict": {"parameter": {r"lm_head\.weight": [Shard(0)], r"transformer\.wte\.weight": [Shard(1)]}},
    }.items():
        try:
            parallelize_module(GPT(GPTConfig()), m, plan)
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    return errors


def test_parallelize_module_errors(pool4):
    errors = pool4.run(_case_plan_errors)[0]
    assert "match no parameter" in errors["unmatched"] and "transformer.wte.weight" in errors["unmatched"]
    assert "out of range" in errors["out of range"] and "Shard(dim=2)" in errors["out of range"]
    assert "2 placements" in errors["wrong arity"]
    assert "must end in '.input' or '.output'" in errors["bad forward key"]
    assert "matches no submodule" in errors["forward matches nothing"]
    assert "different placements" in errors["tied conflict"]


class _Odd(torch.nn.Module):
    """Every parameter's size is prime to the DP size, so each one is split unevenly, and
    the blocks live in a ModuleList (ZeRO-3 gathers them unit by unit)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(7, 7) for _ in range(2))
        self.head = torch.nn.Linear(7, 3)
        self.scale = torch.nn.Parameter(torch.ones(5))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).pow(2).mean() * self.scale.sum()


def _odd_steps(model, opt, rows, steps=4):
    losses = []
    for step in range(steps):
        x = torch.randn(8, 7, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = model(x[rows])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


# SGD (momentum, weight decay) for the parameters compared tightly; AdamW for its
# sharded state, its parameters within Adam's reach (see dist_utils).
UNEVEN_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2)),
}


def _case_uneven_zero(stage: int, optim: str):
    cls, kwargs = UNEVEN_OPTIMIZERS[optim]
    torch.manual_seed(0)
    ref_model = _Odd()
    ref = _odd_steps(ref_model, cls(ref_model.parameters(), **kwargs), slice(0, 8))
    m = mesh("1d4")
    torch.manual_seed(0)
    model = DDP(_Odd(), m)
    if stage:
        opt = DistributedOptimizer(cls, models=[model], zero_stage=stage, **kwargs)
    else:
        opt = cls(model.parameters(), **kwargs)
    rank = dist.get_rank()
    losses = torch.stack(_odd_steps(model, opt, slice(2 * rank, 2 * rank + 2)))
    dist.all_reduce(losses)
    failures = [mismatch(losses / 4, torch.stack(ref), rtol=1e-5, atol=1e-7)]
    with opt.full_parameters() if stage else contextlib.nullcontext():
        for (name, p), r in zip(model.module.named_parameters(), ref_model.parameters()):
            if optim == "adamw":
                err = adam_mismatch(p.detach(), r.detach(), lr=kwargs["lr"], steps=len(ref))
            else:
                err = mismatch_to_max(p.detach(), r.detach())
            failures.append(err and f"{name}: {err}")
    return [f for f in failures if f]


@pytest.mark.parametrize("optim", list(UNEVEN_OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_with_uneven_parameters(pool4, stage, optim):
    assert pool4.run(_case_uneven_zero, stage, optim) == [[]] * 4
