"""vescale.parallelize with a pipeline on 4 ranks: clipping with a parameter tied across
stages, evaluation, recomputation, ZeRO-3 and the model's own activation checkpointing
under the schedules; every number is one device's (the helpers and the RFC loop are
test_parallelize.py's)."""

import contextlib
import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import vescale
from vescale import Plan
from vescale._local import local_of
from vescale.parallel.plans import gpt_plan

from dist_utils import mismatch
from test_parallelize import (GLOBAL_BATCH, STEPS, _Tokens, _adamw, _dataset, _gpt, _hf_loss, _llama, _rfc_loop, _sgd,
                              _single_device)


# ---- clipping under a pipeline: a parameter tied across stages counts once ------------------------

def _case_pipeline_clip(mesh: dict, extra: dict) -> tuple[float, float, list[float], list[float]]:
    """The global gradient norm of a pipeline whose first and last stages both hold the
    tied embedding (and its gradient, summed over them), then clipped training's losses,
    against one device's."""
    data = _dataset()
    x, y = data.tensors[0][:GLOBAL_BATCH], data.tensors[1][:GLOBAL_BATCH]
    plan = Plan({"mesh": mesh, "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 4}), _adamw, None, _dataset())
    model(next(iter(loader))).backward()
    norm = float(optimizer.clip_grad_norm_(1e9))
    ref_model = _gpt({"n_layer": 4})
    ref_model(x, y).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9))

    plan.update({"gradient.clip_norm": 0.05})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 4}), _adamw, None, _dataset())
    losses = _rfc_loop(model, optimizer, loader, STEPS)
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    return norm, ref_norm, losses, _single_device(lambda: _gpt({"n_layer": 4}), _adamw, batches, clip=0.05)


@pytest.mark.parametrize("mesh,extra", [({"PP": 4}, {"pipeline_parallel.microbatches": 4}),
                                        ({"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2,
                                                              "data_parallel.zero_stage": 1})],
                         ids=["pp4", "pp2-dp2-zero1"])
def test_clipping_under_a_pipeline_counts_tied_parameters_once(pool4, mesh, extra):
    for norm, ref_norm, losses, ref in pool4.run(_case_pipeline_clip, mesh, extra):
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)



# ---- evaluation, recomputation and ZeRO-3 under a pipeline ------------------------------------------

def _case_pipeline_eval(mesh: dict, extra: dict) -> tuple[list[float], list[float]]:
    """Train a step, evaluate (eval mode, no_grad) on a batch, train a step more, evaluate
    in eval mode without no_grad: the pipeline runs its forward passes only, and every
    number is one device's."""
    plan = Plan({"mesh": mesh, "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 4}), _sgd, None, _dataset())
    data = _dataset()
    x, y = data.tensors[0][:GLOBAL_BATCH], data.tensors[1][:GLOBAL_BATCH]
    ref = _gpt({"n_layer": 4})
    ref_opt = _sgd(ref)
    got, want = [], []
    batches = iter(loader)
    for i in range(2):
        optimizer.zero_grad()
        loss = model(next(batches))
        loss.backward()
        optimizer.step()
        got.append(loss.item())
        ref_opt.zero_grad()
        ref_loss = ref(data.tensors[0][i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH],
                       data.tensors[1][i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH])
        ref_loss.backward()
        ref_opt.step()
        want.append(ref_loss.item())
        model.eval()
        ref.eval()
        with torch.no_grad() if i == 0 else contextlib.nullcontext():
            got.append(float(model((x, y))))
            want.append(float(ref(x, y)))
        model.train()
        ref.train()
    return got, want


@pytest.mark.parametrize("mesh, extra", [
    ({"PP": 2, "TP": 2}, {"tensor_parallel.sharding_plan": gpt_plan(), "pipeline_parallel.microbatches": 2}),
    ({"PP": 2, "DP": 2}, {"pipeline_parallel.schedule": "interleaved_1f1b", "pipeline_parallel.virtual_stages": 2,
                          "pipeline_parallel.microbatches": 2}),
    ({"PP": 2, "DP": 2}, {"pipeline_parallel.schedule": "zbv", "pipeline_parallel.virtual_stages": 2,
                          "pipeline_parallel.microbatches": 2, "data_parallel.zero_stage": 1}),
], ids=["pp2-tp2-1f1b", "pp2-dp2-interleaved", "pp2-dp2-zbv-zero1"])
def test_evaluation_through_a_pipeline_matches_single_device(pool4, mesh, extra):
    for got, want in pool4.run(_case_pipeline_eval, mesh, extra):
        assert mismatch(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6) is None, (got, want)


def _case_pipeline_recompute(mesh: dict, extra: dict) -> tuple[list[float], list[float], int, int]:
    """Recomputation of every block under a pipeline: the losses of three steps, one
    device's, and how many times this rank's MLPs ran on real values without and with it."""
    def run(recompute: bool) -> tuple[list[float], int]:
        plan = Plan({"mesh": mesh, "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra,
                     "recompute.modules": [r"transformer\.h\.\d+"] if recompute else []})
        gpt = _gpt({"n_layer": 4})
        calls = [0]
        for block in gpt.transformer.h:  # (a pre-hook: recomputation stops once it has what backward needs)
            block.mlp.register_forward_pre_hook(lambda m, args: calls.__setitem__(0, calls[0] + (not args[0].is_meta)))
        model, optimizer, _, loader = vescale.parallelize(plan, gpt, _sgd, None, _dataset())
        return _rfc_loop(model, optimizer, loader, 3), calls[0]

    plain_losses, plain_calls = run(False)
    losses, calls = run(True)
    data = _dataset()
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * 3, GLOBAL_BATCH)]
    return losses + plain_losses, 2 * _single_device(lambda: _gpt({"n_layer": 4}), _sgd, batches), plain_calls, calls


@pytest.mark.parametrize("mesh, extra", [
    ({"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2, "data_parallel.zero_stage": 3}),
    ({"PP": 2, "TP": 2}, {"tensor_parallel.sharding_plan": gpt_plan(), "pipeline_parallel.schedule": "interleaved_1f1b",
                          "pipeline_parallel.virtual_stages": 2, "pipeline_parallel.microbatches": 2}),
], ids=["pp2-dp2-1f1b-zero3", "pp2-tp2-interleaved"])
def test_recomputation_under_a_pipeline_matches_single_device(pool4, mesh, extra):
    for losses, ref, plain_calls, calls in pool4.run(_case_pipeline_recompute, mesh, extra):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
        assert plain_calls > 0 and calls == 2 * plain_calls, (plain_calls, calls)  # every block ran again


def _case_zero3_shadows(extra: dict) -> tuple[int, int, list[float], list[float]]:
    """ZeRO-3 under a schedule whose ranks hold several stages: a later stage's forward runs
    the earlier stages' blocks as shadows on meta twins of their parameters. Counts the
    all-gathers of parameters the model does not hold at that moment (shadowed), and all."""
    from vescale.parallel import zero3
    plan = Plan({"mesh": {"PP": 2, "DP": 2}, "data_parallel.zero_stage": 3, "data.global_batch_size": GLOBAL_BATCH,
                 "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 4}), _sgd, None, _dataset())
    gathers = {"shadowed": 0, "all": 0}
    gather = zero3.ShardedParameters.gather

    def counting(self, entries):
        held = {id(p) for p in model.module.module.module.parameters()}  # ParallelModel > DDP > pipeline > GPT
        empty = [e for e in entries if local_of(e.param).untyped_storage().nbytes() == 0]
        gathers["all"] += bool(empty)
        gathers["shadowed"] += bool(empty) and any(id(e.param) not in held for e in empty)
        return gather(self, entries)

    zero3.ShardedParameters.gather = counting
    try:
        losses = _rfc_loop(model, optimizer, loader, 3)
    finally:
        zero3.ShardedParameters.gather = gather
    data = _dataset()
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * 3, GLOBAL_BATCH)]
    return gathers["shadowed"], gathers["all"], losses, _single_device(lambda: _gpt({"n_layer": 4}), _sgd, batches)


@pytest.mark.parametrize("extra", [
    {"pipeline_parallel.schedule": "interleaved_1f1b", "pipeline_parallel.virtual_stages": 2,
     "pipeline_parallel.microbatches": 4},
    {"pipeline_parallel.schedule": "zbv", "pipeline_parallel.virtual_stages": 2, "pipeline_parallel.microbatches": 2},
], ids=["interleaved", "zbv"])
def test_zero3_does_not_gather_for_a_pipelines_shadows(pool4, extra):
    """A shadow computes on meta: gathering its unit moved a whole block per micro-batch for
    nothing (rank 0 of interleaved PP2 x VP2, 4 micro-batches: 25% of its gathered bytes)."""
    for shadowed, gathers, losses, ref in pool4.run(_case_zero3_shadows, extra):
        assert shadowed == 0 and gathers > 0, (shadowed, gathers)
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


# ---- the user's own activation checkpointing under the schedules ----------------------------------

def _checkpointed_gpt(reentrant: bool):
    """The project's GPT with every block under torch.utils.checkpoint, as users write it."""
    gpt = _gpt({"n_layer": 4})
    for block in gpt.transformer.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=reentrant)
    return gpt


def _case_user_checkpoints(model_name: str, mesh: dict, extra: dict, reentrant: bool):
    """Three SGD steps of a model that checkpoints its own blocks (the project's GPT, or
    Hugging Face's gradient_checkpointing_enable), one device's losses, and whether this
    rank warned that a zero-bubble split met a reentrant checkpoint."""
    settings = {"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra}
    if model_name == "gpt":
        model, dataset, call = _checkpointed_gpt(reentrant), _dataset(), None
        plan = Plan({"mesh": mesh, **settings})
        data = _dataset()
        batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
                   for i in range(0, GLOBAL_BATCH * 3, GLOBAL_BATCH)]
        ref = _single_device(lambda: _gpt({"n_layer": 4}), _sgd, batches)
    else:
        model, dataset, call = _llama(), _Tokens(), _hf_loss
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        plan = Plan.from_hf(model, mesh=mesh, **settings)
        ids = _Tokens().ids
        batches = [(ids[i:i + GLOBAL_BATCH], None) for i in range(0, GLOBAL_BATCH * 3, GLOBAL_BATCH)]
        ref = _single_device(_llama, _sgd, batches, call=lambda m, x, _: m(input_ids=x, labels=x).loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, _, loader = vescale.parallelize(plan, model, _sgd, None, dataset)
        losses = _rfc_loop(model, optimizer, loader, 3, call=call)
    return losses, ref, any("use_reentrant=True" in str(w.message) for w in caught)


ZB_H1 = {"pipeline_parallel.schedule": "zb_h1", "pipeline_parallel.microbatches": 2}
ZB_V = {"pipeline_parallel.schedule": "zbv", "pipeline_parallel.virtual_stages": 2, "pipeline_parallel.microbatches": 2}


@pytest.mark.parametrize("model_name,mesh,extra,reentrant", [
    ("gpt", {"PP": 2, "DP": 2}, ZB_H1, True),
    ("gpt", {"PP": 2, "DP": 2}, ZB_V, True),
    ("gpt", {"PP": 2, "DP": 2}, ZB_V, False),
    ("gpt", {"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2, "data_parallel.zero_stage": 3}, True),
    ("hf", {"PP": 2, "TP": 2}, ZB_H1, True),
    ("hf", {"PP": 2, "DP": 2}, ZB_V, False),
], ids=["gpt-zbh1-reentrant", "gpt-zbv-reentrant", "gpt-zbv", "gpt-1f1b-zero3-reentrant", "hf-tp2-zbh1-reentrant",
        "hf-zbv"])
def test_users_own_checkpointing_under_a_pipeline(pool4, model_name, mesh, extra, reentrant):
    """A model's own torch.utils.checkpoint trains to one device's losses under every
    schedule. A reentrant checkpoint refuses torch's split of the backward into input and
    weight halves (zero-bubble schedules): the last stage raised while the first waited
    for its gradient, a hang. Those micro-batches now run their backward whole, with a
    warning that names the fix."""
    results = pool4.run(_case_user_checkpoints, model_name, mesh, extra, reentrant)
    for losses, ref, _ in results:
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
    zero_bubble = extra.get("pipeline_parallel.schedule") in ("zb_h1", "zbv")
    assert any(warned for *_, warned in results) == (reentrant and zero_bubble)


# ---- predictions: the model's outputs through the stages ------------------------------------------

def _case_predict(model_name: str, mesh: dict, extra: dict) -> list[str]:
    """``predict`` of this rank's batch (and, for GPT, of its inputs alone: the logits)
    against one device's call of the same model on the same batch, in eval mode, before
    and after one SGD step of the first global batch on both sides."""
    settings = {"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra}
    if model_name == "gpt":
        model, dataset, build = _gpt({"n_layer": 4}), _dataset(), lambda: _gpt({"n_layer": 4})
        plan = Plan({"mesh": mesh, **settings})
    else:
        model, dataset, build = _llama(), _Tokens(), _llama
        plan = Plan.from_hf(model, mesh=mesh, **settings)
    parallel, optimizer, _, loader = vescale.parallelize(plan, model, _sgd, None, dataset)
    batch = next(iter(loader))
    ref = build()
    failures = []
    for when in ("before training", "after a step"):
        ref.eval()
        parallel.eval()
        with torch.no_grad():
            if model_name == "gpt":
                cases = {"loss": (parallel.predict(batch), ref(*batch)),
                         "logits": (parallel.predict(batch[0]), ref(batch[0]))}
            else:
                out, want = parallel.predict(batch), ref(**batch)
                cases = {"loss": (out.loss, want.loss), "logits": (out.logits, want.logits),
                         "no cache": (out.past_key_values, None)}
        for what, (got, want) in cases.items():
            if want is None:
                if got is not None:
                    failures.append(f"{when}, {what}: {type(got).__name__}")
            elif not isinstance(got, torch.Tensor) or isinstance(got, vescale.DTensor):
                failures.append(f"{when}, {what}: a {type(got).__name__}, not a plain tensor")
            elif (bad := mismatch(got, want, rtol=1e-5, atol=1e-6)) is not None:
                failures.append(f"{when}, {what}: {bad}")
        if when == "before training":
            if any(p.grad is not None for p in parallel.parameters()):
                failures.append("predict left gradients")
            # one SGD step of the global batch on both sides: predictions follow training
            parallel.train()
            ref.train()
            optimizer.zero_grad()
            (parallel(batch) if model_name == "gpt" else _hf_loss(parallel, batch)).backward()
            optimizer.step()  # this rank's part of the first global batch, as the reference's
            ref_opt = _sgd(ref)
            ref_opt.zero_grad()
            if model_name == "gpt":
                rows = dataset.tensors
                ref(rows[0][:GLOBAL_BATCH], rows[1][:GLOBAL_BATCH]).backward()
            else:
                ids = dataset.ids[:GLOBAL_BATCH]
                ref(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
    return failures


@pytest.mark.parametrize("model_name,mesh,extra", [
    ("gpt", {"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2}),
    ("gpt", {"PP": 2, "DP": 2}, ZB_V),
    ("gpt", {"PP": 4}, {"pipeline_parallel.schedule": "gpipe", "pipeline_parallel.microbatches": 4}),
    ("hf", {"PP": 2, "TP": 2}, {"pipeline_parallel.microbatches": 2}),
    ("hf", {"DP": 2, "TP": 2}, {}),
    ("gpt", {"PP": 2, "DP": 2}, {**ZB_V, "data_parallel.zero_stage": 3}),
    ("hf", {"PP": 2, "TP": 2}, {"pipeline_parallel.microbatches": 2, "tensor_parallel.sequence_parallel": True}),
], ids=["gpt-pp2-dp2", "gpt-zbv", "gpt-pp4", "hf-pp2-tp2", "hf-dp2-tp2-no-pipeline", "gpt-zbv-zero3", "hf-pp2-tp2-sp"])
def test_predict_matches_single_device(pool4, model_name, mesh, extra):
    """``model.predict(batch)``: the model's own outputs (a loss, logits, a Hugging Face
    ModelOutput) on every rank, as one device's call gives them for that rank's batch:
    through the stages when there is a pipeline (micro-batches joined, a DTensor gathered,
    no KV cache), a plain call otherwise; before training (the pipeline's first call) and
    after an SGD step, so that predictions and training do not disturb each other."""
    for rank, failures in enumerate(pool4.run(_case_predict, model_name, mesh, extra)):
        assert failures == [], f"rank {rank}: {failures}"
