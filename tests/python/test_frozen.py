"""Parameters that do not train, under vescale.parallelize's plans. Frozen ones
(fine-tuning: requires_grad=False on embeddings, blocks or norms) stay as on one device
(never stepped, not even by weight decay or momentum), also when frozen between steps;
unfreezing one after the model was made data parallel is refused on every rank, naming
the fix, instead of training it apart from one device's. Parameters the script leaves
out of its optimizer get gradients (a global clip counts them) and no step, until
``optimizer.add_param_group`` adds them."""

import functools

import pytest
import torch

import vescale
from vescale import Plan
from vescale.parallel.plans import gpt_plan

from dist_utils import mismatch
from test_parallelize import GLOBAL_BATCH, STEPS, _dataset, _gpt

SP = {"tensor_parallel.sharding_plan": gpt_plan(sequence_parallel=True), "tensor_parallel.sequence_parallel": True}
PLANS = {
    "dp4-zero1": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 1},
    "dp4-zero2": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 2},
    "dp4-zero3": {"mesh": {"DP": 4}, "data_parallel.zero_stage": 3},
    "dp2-tp2-sp-zero3": {"mesh": {"DP": 2, "TP": 2}, **SP, "data_parallel.zero_stage": 3},
    "tp4-sp": {"mesh": {"TP": 4}, **SP},
    "pp2-dp2": {"mesh": {"PP": 2, "DP": 2}, "pipeline_parallel.microbatches": 2},
    "pp2-dp2-zero3": {"mesh": {"PP": 2, "DP": 2}, "pipeline_parallel.microbatches": 2, "data_parallel.zero_stage": 3},
    "pp4": {"mesh": {"PP": 4}, "pipeline_parallel.microbatches": 4},
}

FROZEN = {  # by the one-device name; "embeddings" holds the token embedding GPT ties to its head
    "embeddings": lambda n: n.startswith(("transformer.wte", "transformer.wpe")),
    "first-block": lambda n: n.startswith("transformer.h.0."),
    "norms": lambda n: ".ln_" in n,
}


def _set(model, frozen: str, requires_grad: bool) -> None:
    for n, p in model.named_parameters():
        if FROZEN[frozen](n):
            p.requires_grad_(requires_grad)


def _model(frozen: str | None):
    model = _gpt({"n_layer": 4})
    if frozen:
        _set(model, frozen, False)
    return model


def _sgd(model):  # every parameter, frozen ones too (torch skips those without .grad)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, vescale.DTensor) else t


def _values(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole (ZeRO-3 gathers them for the read: between
    steps its parameters are empty)."""
    with optimizer.full_parameters():
        return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _train(model, optimizer, batches, change=None, before_step=None) -> list[float]:
    """A step per batch; ``change(model)`` before the third, ``before_step(model)`` before each step."""
    losses = []
    for i, batch in enumerate(batches):
        if i == 2 and change is not None:
            change(model)
        optimizer.zero_grad()
        loss = model(*batch) if isinstance(batch, tuple) else model(batch)
        loss.backward()
        if before_step is not None:
            before_step(model)
        optimizer.step()
        losses.append(_full(loss).item())
    return losses


def _one_device(frozen: str | None, change=None) -> list[float]:
    data, ref = _dataset(), _model(frozen)
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    return _train(ref, _sgd(ref), batches, change)


def _parallel(name: str, frozen: str | None):
    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _model(frozen), _sgd, None, _dataset())
    return model, optimizer, [b for _, b in zip(range(STEPS), loader)]


def _case_frozen(name: str, frozen: str) -> tuple[list[float], list[float], float]:
    model, optimizer, batches = _parallel(name, frozen)
    start = _values(model, optimizer)
    losses = _train(model, optimizer, batches)
    end = _values(model, optimizer)
    # (a pipeline rank may hold none)
    moved = max((float((end[n] - v).abs().max()) for n, v in start.items() if FROZEN[frozen](n)), default=0.0)
    return losses, _one_device(frozen), moved


@pytest.mark.parametrize("name,frozen", [
    ("dp4-zero1", "embeddings"), ("dp4-zero2", "norms"), ("dp4-zero3", "first-block"),
    ("dp2-tp2-sp-zero3", "norms"), ("tp4-sp", "norms"), ("pp2-dp2", "embeddings"), ("pp4", "embeddings"),
    ("pp2-dp2-zero3", "first-block")])
def test_frozen_parameters_train_as_on_one_device(pool4, name, frozen):
    """The script's optimizer gets every parameter, frozen ones too, with momentum and
    weight decay. Under ZeRO it used to refuse them ("not a parameter of the DDP models");
    a pipeline gave the frozen embedding that several stages hold (GPT ties it to the head)
    a zero gradient, which weight decay then stepped: losses off from the third digit."""
    for losses, ref, moved in pool4.run(_case_frozen, name, frozen):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
        assert moved == 0.0, f"a frozen parameter moved by {moved}"


def _case_change(name: str, frozen: str | None, thaw: str | None):
    """Freezes ``frozen`` (thaw None) or unfreezes ``thaw`` before the third step."""
    model, optimizer, batches = _parallel(name, thaw)
    change = (lambda m: _set(m, thaw, True)) if thaw else (lambda m: _set(m, frozen, False))
    if not thaw:
        return _train(model, optimizer, batches, change), _one_device(None, change)
    losses = _train(model, optimizer, batches[:2])
    change(model)
    before = _values(model, optimizer)
    try:
        _train(model, optimizer, batches[2:3])
    except RuntimeError as e:
        after = _values(model, optimizer)
        return str(e), all(torch.equal(after[n], v) for n, v in before.items()), losses
    return "", False, losses


@pytest.mark.parametrize("name,frozen", [("dp4-zero2", "norms"), ("pp2-dp2", "embeddings")])
def test_freezing_between_steps_trains_as_on_one_device(pool4, name, frozen):
    for losses, ref in pool4.run(_case_change, name, frozen, None):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


@pytest.mark.parametrize("name,thaw", [("dp4-zero1", "embeddings"), ("dp2-tp2-sp-zero3", "norms"),
                                       ("pp2-dp2", "first-block"), ("pp2-dp2-zero3", "norms")])
def test_unfreezing_after_parallelize_is_refused_on_every_rank(pool4, name, thaw):
    """A parameter frozen when the model was made data parallel has no gradient bucket
    and no ZeRO slice: unfrozen later, its gradient stayed each rank's own (DDP) or it was
    never stepped (ZeRO), silently. Now every rank raises before anything is stepped,
    also the pipeline ranks whose stage holds none of them ("first-block": stage 0's)."""
    for err, unchanged, _ in pool4.run(_case_change, name, None, thaw):
        assert "frozen (requires_grad=False) when the model was made data parallel" in err, err
        assert "parallelize the model again" in err, err
        assert unchanged


def _blocks_only(model):  # the script's optimizer: the blocks' parameters, not the embeddings or the final norm
    return torch.optim.SGD([p for n, p in model.named_parameters() if ".h." in n], lr=0.1, momentum=0.9,
                           weight_decay=0.1)


def _case_outside_the_optimizer(name: str) -> tuple[list[float], list[float]]:
    """Losses, then the clip's norms, of every step (the ranks', then one device's)."""
    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _model(None), _blocks_only, None, _dataset())
    norms, ref_norms = [], []
    losses = _train(model, optimizer, [b for _, b in zip(range(STEPS), loader)],
                    before_step=lambda m: norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))))
    data, ref = _dataset(), _model(None)
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    ref_losses = _train(ref, _blocks_only(ref), batches,
                        before_step=lambda m: ref_norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                                                     0.05))))
    return losses + norms, ref_losses + ref_norms


@pytest.mark.parametrize("name", ["dp4-zero1", "dp4-zero2", "dp4-zero3", "dp2-tp2-sp-zero3", "pp2-dp2-zero3", "pp2-dp2", "tp4-sp"])
def test_parameters_outside_the_optimizer_are_not_stepped(pool4, name):
    """The script's optimizer takes the blocks only; the embeddings and final norm still
    require grad and the loop clips over all the model's parameters, zeroing gradients
    with optimizer.zero_grad() alone: theirs accumulate over the steps, as on one device,
    and count in the norm. ZeRO refused this ("parameters ... are in no group; add them to
    a group", which would train them); then its zero_grad cleared them too (norms 1e-3 off)."""
    for losses, ref in pool4.run(_case_outside_the_optimizer, name):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _case_nothing_crosses(frozen_blocks: int, reentrant: bool) -> str:
    """PP2 over 4 blocks (stage 0: the embeddings and blocks 0-1), embeddings frozen, and
    ``frozen_blocks`` blocks too; ``reentrant``: torch.utils.checkpoint around each block."""
    from torch.utils.checkpoint import checkpoint
    model = _model("embeddings")
    for block in model.transformer.h[:frozen_blocks]:
        block.requires_grad_(False)
    if reentrant:
        for block in model.transformer.h:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=True)
    plan = Plan({"mesh": {"PP": 2, "DP": 2}, "pipeline_parallel.microbatches": 2,
                 "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, model, _sgd, None, _dataset())
    try:
        model(next(iter(loader)))
    except vescale.parallel.pipeline.PipelineSplitError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("frozen_blocks,reentrant", [(2, False), (0, True)])
def test_a_pipeline_refuses_a_first_stage_whose_result_needs_no_gradient(pool4, frozen_blocks, reentrant):
    """What crosses a pipeline cut is told by requires_grad. A first stage with every
    parameter frozen, or frozen embeddings under reentrant checkpointing (whose output
    then does not require grad, on one device too), sent nothing: the next stage computed
    on its stand-in zeros, a loss of ln(vocab) every step, silently (found by the set-up
    fuzzer, seed 150496). It is refused on every rank before any step, naming the ways out."""
    for err in pool4.run(_case_nothing_crosses, frozen_blocks, reentrant):
        assert "would receive nothing from the stage before" in err, err
        assert "use_reentrant=False" in err, err


def _case_group_added(name: str) -> tuple[list[float], list[float]]:
    """The blocks train from the start; the rest (embeddings, final norm) joins as a group of
    its own, with another lr, before the second step, as a two-phase fine-tuning does."""
    def add_the_rest(model, optimizer):
        optimizer.add_param_group({"params": [p for n, p in model.named_parameters() if ".h." not in n], "lr": 0.2})

    def train(model, optimizer, batches):
        return _train(model, optimizer, batches[:1]) + (add_the_rest(model, optimizer) or []) + \
            _train(model, optimizer, batches[1:])

    plan = Plan({**PLANS[name], "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _model(None), _blocks_only, None, _dataset())
    losses = train(model, optimizer, [b for _, b in zip(range(STEPS), loader)])
    data, ref = _dataset(), _model(None)
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    return losses, train(ref, _blocks_only(ref), batches)


@pytest.mark.parametrize("name", ["dp4-zero2", "dp4-zero3", "dp2-tp2-sp-zero3", "pp2-dp2-zero3", "pp2-dp2"])
def test_a_parameter_group_added_after_parallelize_trains_as_on_one_device(pool4, name):
    """torch's add_param_group on the returned optimizer put the parameters themselves in
    the optimizer ZeRO wraps, which never sees their gradients under ZeRO-2/3: the group
    was never stepped (losses 4e-3 off from the third step), silently."""
    for losses, ref in pool4.run(_case_group_added, name):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
