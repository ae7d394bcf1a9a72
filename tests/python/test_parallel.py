"""Unmodified models trained with tensor, sequence and data parallelism and ZeRO match
single-device training of the same model on the same global batch (fp32): the losses
of 5 steps (rtol 1e-5), the first step's gradients (to 1e-5 of each tensor's largest
element) and the final parameters: within Adam's reach after AdamW (2 * lr * steps,
since Adam turns rounding noise in near-zero gradients into lr-sized steps), tightly
after SGD with momentum and weight decay (see dist_utils)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.plans import gpt_plan, llama_plan

from dist_utils import adam_mismatch, full_grads, mesh, mismatch_to_max, training_mismatches
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM

STEPS = 5
GLOBAL_BATCH = 4
LR = {"adamw": 1e-2, "sgd": 0.1}

MODELS = {
    # no biases: attention's key bias has an exactly zero gradient in exact arithmetic
    # (softmax ignores a shift), so its computed gradient is pure rounding noise, which
    # neither a gradient comparison nor AdamW's steps on it can judge
    "gpt": (lambda: GPT(GPTConfig(bias=False)), gpt_plan),
    "llama": (lambda: LlamaForCausalLM(LlamaConfig()), llama_plan),
}

# layout -> (mesh name, tp mesh dim or None, dp mesh dim or None, sequence parallel, zero stage)
LAYOUTS = {
    "tp2": ("1d2", 0, None, False, 0),
    "tp4": ("1d4", 0, None, False, 0),
    "dp2": ("1d2", None, 0, False, 0),
    "dp2_tp2": ("2d", "TP", "DP", False, 0),
    "dp2_tp2_sp": ("2d", "TP", "DP", True, 0),
    "zero1_dp4": ("1d4", None, 0, False, 1),
    "zero2_dp4": ("1d4", None, 0, False, 2),
    "zero2_dp2_tp2": ("2d", "TP", "DP", True, 2),
    "zero3_dp4": ("1d4", None, 0, False, 3),
    "zero3_dp2_tp2": ("2d", "TP", "DP", True, 3),
}


def _batches():
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 64, (GLOBAL_BATCH, 17), generator=g) for _ in range(STEPS)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _optimizer(optim: str, params_or_models, zero: int = 0):
    cls, kwargs = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9})}[optim]
    kwargs.update(lr=LR[optim], weight_decay=0.1)
    if zero:
        return DistributedOptimizer(cls, models=params_or_models, zero_stage=zero, **kwargs)
    return cls(params_or_models, **kwargs)


def _reference(model_name: str, accumulate: int, optim: str):
    torch.manual_seed(0)
    model = MODELS[model_name][0]()
    opt = _optimizer(optim, model.parameters())
    losses, grads = [], None
    for idx, tgt in _batches():
        opt.zero_grad()
        total = 0.0
        for part in range(accumulate):
            rows = slice(part * GLOBAL_BATCH // accumulate, (part + 1) * GLOBAL_BATCH // accumulate)
            loss = model(idx[rows], tgt[rows]) / accumulate
            loss.backward()
            total += loss.item()
        if grads is None:
            grads = full_grads(model)
        opt.step()
        losses.append(total)
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


def _submesh(m, dim):
    if dim is None:
        return None
    return m[dim] if isinstance(dim, str) else m


def _case_train(model_name: str, layout: str, accumulate: int = 1, optim: str = "adamw", no_sync: bool = True,
                zero_grad: str = "optimizer"):
    mesh_name, tp_dim, dp_dim, sp, zero = LAYOUTS[layout]
    m = mesh(mesh_name)
    tp, dp = _submesh(m, tp_dim), _submesh(m, dp_dim)
    factory, plan = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    if tp is not None:
        parallelize_module(model, tp, plan(sequence_parallel=sp))
    dp_size, dp_rank = (dp.size(), dp.get_local_rank()) if dp is not None else (1, 0)
    if dp is not None:
        model = DDP(model, dp)
    opt = _optimizer(optim, [model] if zero else model.parameters(), zero)

    vescale.reset_fallback_counts()
    losses, grads = [], None
    local = GLOBAL_BATCH // dp_size
    for idx, tgt in _batches():
        (opt if zero_grad == "optimizer" else model).zero_grad()
        total = torch.zeros(())
        for part in range(accumulate):
            lo = dp_rank * local + part * local // accumulate
            rows = slice(lo, lo + local // accumulate)
            sync = part == accumulate - 1 or dp is None or not no_sync
            with (model.no_sync() if not sync else torch.enable_grad()):
                loss = model(idx[rows], tgt[rows]) / accumulate
                loss.backward()
            value = loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss.detach()
            total += value
        if dp is not None:
            dist.all_reduce(total, group=dp.get_group())
            total /= dp_size
        if grads is None:
            grads = full_grads(model)
        opt.step()
        losses.append(total.item())

    ref_losses, ref_grads, ref_params = _reference(model_name, accumulate * dp_size if dp is not None else accumulate,
                                                   optim)
    failures = []
    if vescale.fallback_counts():
        failures.append(f"fallbacks: {vescale.fallback_counts()}")
    failures += training_mismatches(losses, ref_losses, grads, ref_grads)
    inner = model.module if isinstance(model, DDP) else model
    with opt.full_parameters() if zero else torch.no_grad():
        for name, p in inner.named_parameters():
            full = p.full_tensor() if isinstance(p, vescale.DTensor) else p.detach()
            if optim == "adamw":
                err = adam_mismatch(full, ref_params[name], lr=LR[optim], steps=STEPS)
            else:
                err = mismatch_to_max(full, ref_params[name])
            if err:
                failures.append(f"{name}: {err}")
    return failures


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("layout", [k for k, v in LAYOUTS.items() if v[0] == "1d2"])
def test_two_ranks(pool2, model_name, layout):
    for failures in pool2.run(_case_train, model_name, layout):
        assert failures == []


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("layout", [k for k, v in LAYOUTS.items() if v[0] != "1d2"])
def test_four_ranks(pool4, model_name, layout):
    for failures in pool4.run(_case_train, model_name, layout):
        assert failures == []


@pytest.mark.parametrize("layout", ["dp2_tp2", "zero2_dp2_tp2"])
def test_gradient_accumulation(pool4, layout):
    for failures in pool4.run(_case_train, "llama", layout, 2):
        assert failures == []


# Accumulation without no_sync, as a script that just calls backward k times does: every
# backward reduces, and the reduced gradients must add up as .grad does. ZeRO-2/3 kept only
# the last backward's slices (the others' gradients lost, silently) until they were added;
# since they add, model.zero_grad() must clear them as the optimizer's does.
@pytest.mark.parametrize("layout,zero_grad", [("dp2_tp2", "optimizer"), ("dp2_tp2_sp", "optimizer"), ("zero2_dp2_tp2", "optimizer"),
                                              ("zero3_dp2_tp2", "optimizer"), ("zero2_dp2_tp2", "model")])
def test_gradient_accumulation_without_no_sync(pool4, layout, zero_grad):
    for failures in pool4.run(_case_train, "llama", layout, 2, "sgd", False, zero_grad):
        assert failures == []


# SGD moves parameters linearly with the gradients, so they are compared tightly: the
# optimizer path itself (ZeRO's slices and write-back, weight decay) on the layouts that
# combine the most.
@pytest.mark.parametrize("layout", ["zero1_dp4", "dp2_tp2_sp", "zero2_dp2_tp2", "zero3_dp2_tp2"])
def test_sgd_parameters_match(pool4, layout):
    for failures in pool4.run(_case_train, "llama", layout, 1, "sgd"):
        assert failures == []


def _case_zero3_prefetch():
    m = mesh("1d4")
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(bias=False)), m)
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=3, lr=0.1)
    idx = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    hits = []
    for _ in range(2):
        before = opt.sharded.prefetch_hits
        model(idx, idx).backward()
        hits.append(opt.sharded.prefetch_hits - before)
        opt.step()
        opt.zero_grad()
    return hits, len(model.module.transformer.h), len(opt.sharded._prefetched)


def test_zero3_prefetches_the_next_unit_in_backward(pool4):
    """Each block's backward gather was started during the backward of the unit after it
    (the root's, then the next block's), as FSDP2 prefetches; nothing is left pending
    after backward. The values are those of test_four_ranks' zero3 layouts."""
    for hits, blocks, pending in pool4.run(_case_zero3_prefetch):
        assert hits == [blocks, blocks]
        assert pending == 0
