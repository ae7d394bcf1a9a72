"""The global loss of vescale.parallelize's model over the DP ranks (vescale/global_loss.py,
pipeline/weights.py): losses that average over targets weigh as one device's over the
global batch (masked prompts, batches padded to their own length, under DP, TP, ZeRO and
pipelines), and a forward that raises on some DP ranks (an empty batch) raises on all."""

import pytest
import torch

import vescale
from vescale import Plan

from dist_utils import mismatch
from test_parallelize import GLOBAL_BATCH, STEPS, _hf_loss, _llama, _rfc_loop, _sgd, _single_device, _Tokens


class _Prompted(_Tokens):
    """Supervised fine-tuning samples: each sample's first tokens (its prompt, 0 to 14 of
    16) are not predicted (labels -100), so the DP ranks' batches hold different numbers
    of targets."""

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:(i * 7) % 15] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _parallelized(mesh: dict, extra: dict, optimizer_fn, compiled: str | None, backend: str = "aot_eager"):
    """vescale.parallelize's model, optimizer and loader for _Prompted; ``compiled``: whether
    torch.compile wraps the model "before" parallelize or the parallel model "after"."""
    torch._dynamo.reset()
    model = _llama()
    plan = Plan.from_hf(model, mesh=mesh, **{"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra})
    if compiled == "before":
        model = torch.compile(model, backend=backend)
    model, optimizer, _, loader = vescale.parallelize(plan, model, optimizer_fn, None, _Prompted())
    if compiled == "after":
        model = torch.compile(model, backend=backend)
    return model, optimizer, loader


def _case_hf_masked(mesh: dict, extra: dict, compiled: str | None = None) -> tuple[list[float], list[float]]:
    model, optimizer, loader = _parallelized(mesh, extra, _sgd, compiled)
    losses = _rfc_loop(model, optimizer, loader, STEPS, call=_hf_loss)
    data = _Prompted()
    batches = [[data[j] for j in range(i, i + GLOBAL_BATCH)] for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    batches = [(torch.stack([b["input_ids"] for b in s]), torch.stack([b["labels"] for b in s])) for s in batches]
    ref = _single_device(_llama, _sgd, batches, call=lambda m, x, y: m(input_ids=x, labels=y).loss)
    return losses, ref


@pytest.mark.parametrize("mesh,extra", [({"DP": 4}, {}), ({"DP": 2, "TP": 2}, {"data_parallel.zero_stage": 1}),
                                        ({"DP": 4}, {"data_parallel.zero_stage": 3}),
                                        ({"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2}),
                                        ({"PP": 2, "TP": 2}, {"pipeline_parallel.microbatches": 4,
                                                              "pipeline_parallel.schedule": "zb_h1"}),
                                        ({"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2,
                                                              "data_parallel.zero_stage": 2}),
                                        ({"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2,
                                                              "data_parallel.zero_stage": 3})],
                         ids=["dp4", "dp2-tp2-zero1", "dp4-zero3", "pp2-dp2", "pp2-tp2-zbh1", "pp2-dp2-zero2",
                              "pp2-dp2-zero3"])
def test_masked_targets_weigh_as_one_device_does(pool4, mesh, extra):
    """Prompt tokens masked with -100: one device's loss is the mean over the global
    batch's targets, and the ranks (and a pipeline's micro-batches) hold different numbers
    of them. Each loss is weighted by its targets (the cross-entropy's own divisor; under a
    pipeline the step's gradients are rescaled once the total is known), so losses and,
    through SGD, gradients equal one device's; a mean of the means (torch's DDP) is off."""
    for losses, ref in pool4.run(_case_hf_masked, mesh, extra):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _case_hf_masked_eval(mesh: dict, extra: dict, compiled: str | None = None) -> tuple[list[float], list[float]]:
    # inductor: aot_eager still runs aten's nll_loss_forward, which the engine's watch sees
    model, _, loader = _parallelized(mesh, extra, _sgd, compiled, backend="inductor")
    model.eval()
    with torch.no_grad():
        losses = [_hf_loss(model, batch) for _, batch in zip(range(STEPS), loader)]
    losses = [(x.full_tensor() if isinstance(x, vescale.DTensor) else x).item() for x in losses]
    data, ref_model = _Prompted(), _llama().eval()
    ref = []
    with torch.no_grad():
        for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH):
            samples = [data[j] for j in range(i, i + GLOBAL_BATCH)]
            ref.append(ref_model(input_ids=torch.stack([b["input_ids"] for b in samples]),
                                 labels=torch.stack([b["labels"] for b in samples])).loss.item())
    return losses, ref


@pytest.mark.parametrize("mesh,extra", [({"DP": 4}, {}), ({"DP": 2, "TP": 2}, {}),
                                        ({"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2,
                                                              "data_parallel.zero_stage": 3}),
                                        ({"PP": 2, "TP": 2}, {"pipeline_parallel.microbatches": 4})],
                         ids=["dp4", "dp2-tp2", "pp2-dp2-zero3", "pp2-tp2"])
def test_masked_targets_weigh_as_one_device_does_under_no_grad(pool4, mesh, extra):
    """An evaluation loop (torch.no_grad()) over masked prompts: no autograd node saves
    what the cross-entropy divided by, so the engine watches the forward for it
    (dispatch/loss_watch.cpp); a pipeline's evaluation runs its forwards with autograd on
    and weighs its micro-batches and replicas by their targets. The global loss is one
    device's over the global batch's targets, not a mean of the ranks' (or micro-batches')
    means (weighed by rows, it is off by ~1e-3)."""
    for losses, ref in pool4.run(_case_hf_masked_eval, mesh, extra):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-6, atol=1e-7) is None, (losses, ref)


@pytest.mark.parametrize("case", [_case_hf_masked, _case_hf_masked_eval], ids=["train", "no_grad"])
@pytest.mark.parametrize("mesh,extra,compiled", [({"DP": 4}, {}, "after"),
                                                 ({"DP": 4}, {"data_parallel.zero_stage": 2}, "before")],
                         ids=["dp4-after", "dp4-zero2-before"])
def test_masked_targets_weigh_as_one_device_does_under_torch_compile(pool4, case, mesh, extra, compiled):
    """The model compiled (before or after vescale.parallelize): Dynamo would put the
    cross-entropy in the compiled graph, whose autograd node hides what it divided by, and
    the ranks would weigh by rows (off by ~7e-4). vescale makes Dynamo graph-break at the
    loss (vescale/_compile.py, keep_losses_eager), so it weighs by targets as eagerly."""
    for losses, ref in pool4.run(case, mesh, extra, compiled):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _case_hf_masked_predict(mesh: dict, extra: dict) -> tuple[float, float]:
    model, _, loader = _parallelized(mesh, extra, _sgd, None)
    model.eval()
    with torch.no_grad():
        loss = model.predict(next(iter(loader))).loss.item()
    data, ref_model = _Prompted(), _llama().eval()
    samples = [data[j] for j in range(GLOBAL_BATCH)]
    with torch.no_grad():
        ref = ref_model(input_ids=torch.stack([b["input_ids"] for b in samples]),
                        labels=torch.stack([b["labels"] for b in samples])).loss.item()
    return loss, ref


@pytest.mark.parametrize("mesh,extra", [({"PP": 2, "TP": 2}, {"pipeline_parallel.microbatches": 4}),
                                        ({"PP": 4}, {"pipeline_parallel.microbatches": 4})],
                         ids=["pp2-tp2", "pp4"])
def test_predict_through_a_pipeline_joins_losses_by_their_targets(pool4, mesh, extra):
    """``predict`` returns the model's output for the batch as one device's call does: the
    loss a Hugging Face model computed from masked labels, joined over the micro-batches,
    is the mean over the batch's targets (by rows it is off, or NaN where a micro-batch
    holds no target)."""
    for loss, ref in pool4.run(_case_hf_masked_predict, mesh, extra):
        assert mismatch(torch.tensor([loss]), torch.tensor([ref]), rtol=1e-6, atol=1e-7) is None, (loss, ref)


class _Ragged(_Tokens):
    """Sequences of 4 to 16 tokens, each with its prompt (the first third) masked."""

    def __getitem__(self, i):
        ids = self.ids[i, :4 + (i * 5) % 13]
        labels = ids.clone()
        labels[:len(ids) // 3] = -100
        return {"input_ids": ids, "labels": labels}


def _pad_to_longest(samples: list[dict]) -> dict:
    """Right-padding to the batch's longest sample, pads ignored (-100): a rank's batch is
    as long as its own longest sample, so the DP ranks' batches differ in length."""
    if not samples:
        return {"input_ids": torch.zeros(0, 1, dtype=torch.long), "labels": torch.zeros(0, 1, dtype=torch.long)}
    n = max(len(s["input_ids"]) for s in samples)
    pad = lambda t, v: torch.cat([t, t.new_full((n - len(t),), v)])  # noqa: E731
    return {"input_ids": torch.stack([pad(s["input_ids"], 0) for s in samples]),
            "labels": torch.stack([pad(s["labels"], -100) for s in samples])}


def _case_hf_ragged(mesh: dict, extra: dict) -> tuple[list[float], list[float]]:
    model = _llama()
    plan = Plan.from_hf(model, mesh=mesh, **{"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, model, _sgd, None, _Ragged(), collate_fn=_pad_to_longest)
    losses = _rfc_loop(model, optimizer, loader, STEPS, call=_hf_loss)
    data = _Ragged()
    batches = [_pad_to_longest([data[j] for j in range(i, i + GLOBAL_BATCH)])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    ref = _single_device(_llama, _sgd, [(b["input_ids"], b["labels"]) for b in batches],
                         call=lambda m, x, y: m(input_ids=x, labels=y).loss)
    return losses, ref


@pytest.mark.parametrize("mesh,extra", [({"DP": 4}, {}), ({"DP": 2, "TP": 2}, {"data_parallel.zero_stage": 2})],
                         ids=["dp4", "dp2-tp2-zero2"])
def test_batches_padded_to_their_own_longest_sample_train_as_on_one_device(pool4, mesh, extra):
    """A collate_fn that pads each batch to its own longest sample (dynamic padding): the
    DP ranks' batches differ in length and in targets, one device pads the global batch
    to its longest. Right padding under a causal model changes no real token's logits,
    and the loss weighs each rank by its targets: one device's losses."""
    for losses, ref in pool4.run(_case_hf_ragged, mesh, extra):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _case_hf_empty_rank(mesh: dict) -> tuple[list[float], list[float], list[tuple]]:
    """Two epochs of 8 + 3 samples in global batches of 8, drop_last=False: the last batch
    leaves the last DP rank without rows (1, 1, 1, 0 on DP4; 2, 1 on DP2 is not enough, so
    8 + 1 there: 1, 0), and HF Llama's forward cannot take an empty batch."""
    dp = mesh["DP"]
    n = GLOBAL_BATCH + dp - 1
    model = _llama()
    plan = Plan.from_hf(model, mesh=mesh, **{"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False,
                                             "data.drop_last": False})
    model, optimizer, _, loader = vescale.parallelize(plan, model, _sgd, None, _Tokens(n))
    losses, errors = [], []
    for _ in range(2):
        for batch in loader:
            optimizer.zero_grad()
            try:
                loss = _hf_loss(model, batch)
            except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
                errors.append((type(e).__name__, str(e), " ".join(getattr(e, "__notes__", []))))
                continue
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    ids = _Tokens(n).ids
    ref = _single_device(_llama, _sgd, [(ids[:GLOBAL_BATCH], None)] * 2,
                         call=lambda m, x, _: m(input_ids=x, labels=x).loss)
    return losses, ref, errors


@pytest.mark.parametrize("mesh", [{"DP": 4}, {"DP": 2, "TP": 2}], ids=["dp4", "dp2-tp2"])
def test_a_forward_that_raises_on_an_empty_rank_raises_on_every_rank(pool4, mesh):
    """A model that cannot take an empty batch (HF Llama) on the rank a drop_last=False
    loader left without rows: that rank used to raise alone while the others waited in the
    loss's all-reduce until the collective timeout. Now every rank raises at once, the
    empty rank's error names the cause, and the process goes on: the next epoch's steps
    train as on one device (SGD: the skipped step changed nothing)."""
    results = pool4.run(_case_hf_empty_rank, mesh)
    empty = [r for r in range(4) if r // (4 // mesh["DP"]) == mesh["DP"] - 1]
    for rank, (losses, ref, errors) in enumerate(results):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
        assert len(errors) == 2, errors  # one per epoch
        for kind, text, notes in errors:
            if rank in empty:
                assert "batch has no rows" in notes and "drop_last=True" in notes and "were told" in notes, errors
            else:
                assert kind == "RuntimeError" and f"DP rank(s) [{mesh['DP'] - 1}]" in text, errors
                assert "empty batch" in text and "drop_last=True" in text, errors
