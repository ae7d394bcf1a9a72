"""A loop that reads or edits the parameters between steps (an EMA of the weights, weight
clipping, a hand-made re-scaling, ``p.data.mul_``), under ZeRO: as on one device.

ZeRO-3 empties the parameters between steps; inside ``optimizer.full_parameters()`` they
are whole, and what is written there is kept (it was dropped, silently). A read outside
raises, naming the way out (it killed the process with SIGSEGV), and the loop can go on.
ZeRO-1/2 (and 3) step fp32 masters of bf16/fp16 parameters: an edit of the parameter
between steps is taken into the master before the step (the old master was written back
over it, silently)."""

import contextlib
import os

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import vescale
from vescale import Plan

from dist_utils import mismatch
from test_frozen import PLANS, _full
from test_parallelize import GLOBAL_BATCH, STEPS, _dataset, _gpt, _rfc_loop


def _batches():
    data = _dataset()
    return [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
            for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]


@torch.no_grad()
def _edit(model) -> None:
    """What a loop may do between steps: re-scale the (tied) embedding, clip a block's
    weights, through .data too."""
    for n, p in model.named_parameters():
        if n == "transformer.wte.weight":
            p.mul_(3.0)
        elif n.startswith("transformer.h.0.attn."):
            p.data.clamp_(-0.02, 0.02)


def _train(model, optimizer, batches, whole=contextlib.nullcontext) -> tuple[list[float], list[torch.Tensor]]:
    """Losses, and an EMA of the parameters (updated after each step), with an edit before
    the third step; then the EMA weights evaluated (copied in, and the trained ones back)
    and one more step. ``whole()``: the context that makes the parameters readable."""
    losses, ema = [], None
    params = [p for p in model.parameters() if p.device.type != "meta"]  # (a pipeline rank: its stages')
    for i, batch in enumerate(batches):
        if i == 2:
            with whole():
                _edit(model)
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        losses.append(_full(loss).item())
        with whole(), torch.no_grad():
            ema = [p.detach().clone() for p in params] if ema is None else \
                [e.lerp_(p.detach(), 0.25) for e, p in zip(ema, params)]
    with whole(), torch.no_grad():
        trained = [p.detach().clone() for p in params]
        for p, e in zip(params, ema):
            p.copy_(e)
        model.eval()
        losses.append(_full(model(*batches[0])).item())
        model.train()
        for p, t in zip(params, trained):
            p.copy_(t)
    optimizer.zero_grad()
    loss = model(*batches[1])
    loss.backward()
    optimizer.step()
    return losses + [_full(loss).item()], [_full(e) for e in ema]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _case_edits(name: str):
    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 2}), _sgd, None, _dataset())
    losses, ema = _train(model, optimizer, [b for _, b in zip(range(STEPS), loader)], optimizer.full_parameters)
    ref = _gpt({"n_layer": 2})
    ref_losses, ref_ema = _train(ref, _sgd(ref), _batches())
    # (a pipeline rank holds its stages' parameters only: its EMA is of those, in the model's order)
    held = {n for n, p in model.named_parameters() if p.device.type != "meta"}
    ref_ema = [e for (n, _), e in zip(ref.named_parameters(), ref_ema) if n in held]
    return losses, ref_losses, [mismatch(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ema, ref_ema)]


@pytest.mark.parametrize("name", ["dp4-zero3", "dp2-tp2-sp-zero3", "pp2-dp2-zero3", "dp4-zero2"])
def test_edits_and_an_ema_between_steps_train_as_on_one_device(pool4, name):
    """ZeRO-3 dropped what was written inside full_parameters() (losses 4.16 where one
    device's were 17.1 after the edit)."""
    for losses, ref, ema in pool4.run(_case_edits, name):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
        assert ema and all(m is None for m in ema), ema


def _case_low_precision(name: str) -> float:
    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False,
                 "mixed_precision.param_dtype": "bfloat16"})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 2}),
                                                      lambda m: torch.optim.SGD(m.parameters(), lr=0.0), None,
                                                      _dataset())
    batches = iter(loader)
    for _ in range(2):
        optimizer.zero_grad()
        model(*next(batches)).backward()
        optimizer.step()  # lr 0: the parameters stay, through their fp32 masters
    with optimizer.full_parameters():
        _edit(model)
        edited = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    model(*next(batches)).backward()
    optimizer.step()
    with optimizer.full_parameters():
        return max(float((_full(p.detach()) - edited[n]).abs().max()) for n, p in model.named_parameters())


@pytest.mark.parametrize("name", ["dp4-zero1", "dp4-zero2", "dp4-zero3", "dp2-tp2-sp-zero3"])
def test_edits_of_bf16_parameters_survive_the_next_step(pool4, name):
    """The fp32 masters of bf16 parameters were written back over the edit at the next
    step (ZeRO-1/2: the parameters went back to their values before it)."""
    for moved in pool4.run(_case_low_precision, name):
        assert moved == 0.0, moved


def _case_read_outside(name: str):
    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 2}), _sgd, None, _dataset())
    batches = [b for _, b in zip(range(STEPS), loader)]
    errors = []
    for attempt in (lambda p: p.detach().clone(), lambda p: p.norm(), lambda p: p.data.mul_(2.0),
                    lambda p: torch.nn.utils.parameters_to_vector([p])):
        try:
            attempt(next(model.parameters()))
        except RuntimeError as e:
            errors.append(str(e))
    try:
        AveragedModel(model)  # copy.deepcopy(model)
    except TypeError as e:
        errors.append(str(e))
    shapes = [tuple(p.shape) for p in model.parameters()]  # metadata stays readable
    described = repr(next(model.parameters()))
    losses, _ = _train(model, optimizer, batches, optimizer.full_parameters)
    ref = _gpt({"n_layer": 2})
    return errors, shapes, described, losses, _train(ref, _sgd(ref), _batches())[0], \
        [tuple(p.shape) for p in ref.parameters()]


@pytest.mark.parametrize("name", ["dp4-zero3", "dp2-tp2-sp-zero3"])
def test_reading_a_parameter_zero3_emptied_raises_and_the_loop_goes_on(pool4, name):
    """It read a null pointer: SIGSEGV, the process gone. A copy of the model
    (AveragedModel's) raises too, naming the EMA recipe the other tests run (it raised
    "cannot pickle ProcessGroup")."""
    for errors, shapes, described, losses, ref, ref_shapes in pool4.run(_case_read_outside, name):
        assert len(errors) == 5, errors
        assert "AveragedModel" in errors[-1] and "ema = [p.detach().clone() for p in model.parameters()]" in errors[-1]
        for e in errors[:-1]:
            assert "parameter 'transformer.wte.weight'" in e and "with optimizer.full_parameters():" in e, e
        assert shapes == ref_shapes
        assert "empty between steps" in described, described
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


@torch.no_grad()
def _scale_norms(model) -> None:
    for n, p in model.named_parameters():
        if ".ln_" in n:
            p.mul_(0.75)


def _case_deferred(name: str, how: str):
    """A ``deferred_init`` model (parameters meta until the first step) edited inside
    full_parameters() right after parallelize; ``how``: "loaded" from a checkpoint of a
    ZeRO-3 model saved without its optimizer first, "before": edited before parallelize,
    outside deferred_init (refused, naming the ways)."""
    from examples.models.gpt import GPT, GPTConfig
    config = GPTConfig(dropout=0.0, bias=False, n_layer=2)
    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    torch.manual_seed(0)
    deferred = vescale.deferred_init(GPT, config)
    if how == "before":
        _scale_norms(deferred)
        try:  # (ZeRO-1/2 materialise as they are set up)
            model, optimizer, _, loader = vescale.parallelize(plan, deferred, _sgd, None, _dataset())
            _rfc_loop(model, optimizer, loader, STEPS)
        except vescale.deferred.DeferredInitError as e:
            return str(e), [], []
        return "", [], []
    model, optimizer, _, loader = vescale.parallelize(plan, deferred, _sgd, None, _dataset())
    if how == "loaded":
        import torch.distributed as dist
        saved, _, _, _ = vescale.parallelize(plan, _gpt({"n_layer": 2}), _sgd, None, _dataset())
        path = [f"/tmp/vescale-edits-{os.getpid()}" if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path)
        vescale.save(path[0], {"model": saved})
        vescale.load(path[0], {"model": model})
    with optimizer.full_parameters():
        _scale_norms(model)
    losses = _rfc_loop(model, optimizer, loader, STEPS)
    ref = _gpt({"n_layer": 2})
    _scale_norms(ref)
    return "", losses, _train_plain(ref)


def _train_plain(model) -> list[float]:
    optimizer, losses = _sgd(model), []
    for x, y in _batches():
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name,how", [("pp2-dp2", "edited"), ("pp2-dp2-zero3", "edited"),
                                      ("dp4-zero3", "loaded"), ("dp4-zero1", "before"), ("pp2-dp2-zero3", "before")])
def test_a_deferred_model_edited_after_parallelize_trains_as_on_one_device(pool4, name, how):
    """Under DDP and pipelines a deferred_init model stays meta until its first step: an
    edit of the parameters then was run on meta tensors and dropped when they were
    materialised (losses those of the unedited model), silently. full_parameters() now
    materialises them first; an edit outside any recording (before parallelize) raises
    DeferredInitError naming the ways. A ZeRO-3 model saved without its optimizer read
    its emptied parameters (now its slices)."""
    for err, losses, ref in pool4.run(_case_deferred, name, how):
        if how == "before":
            assert "changed in place after deferred_init returned" in err and "lambda" in err, err
        else:
            assert err == "", err
            assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
