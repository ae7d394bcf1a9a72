"""What differs between the ranks of a drawn set-up (setups.py), beyond which data rows a
DP rank reads: drawn last of all, so that every older seed keeps its set-up.

- **An uneven last batch** (``loop["last"]`` = L): the dataset holds ``epoch_batches - 1``
  global batches and then L < batch samples, read with ``drop_last=False``. The loader
  splits the last batch with ``torch.tensor_split`` (the first DP ranks one more), so
  DP ranks have different numbers of rows, and with L < DP some have none. Only the
  project's GPT takes an empty batch (its forward is shape-generic; the project's Llama
  and every Hugging Face model reshape with ``-1`` and raise on 0 rows), so for the
  others L leaves every rank of a plan without a pipeline at least one row. vescale's
  global loss weighs each DP rank's loss by its share of the global batch (its rows, or
  the targets its cross-entropy averages over: ``vescale/global_loss.py``; here every
  target counts, so the rows times the sequence), so one device's mean over the same global batch (``global_batch_indices`` with
  ``drop_last=False``) is the reference. Under a pipeline uneven DP batches, and batches
  with fewer rows than micro-batches, are refused with a ValueError on every rank (the
  schedule runs backward itself): such a step is expected to raise exactly that on every
  rank, and the runs are compared up to it (``refusal_at``); an L that splits evenly
  over the DP ranks with a row per micro-batch trains (micro-batches of different sizes,
  weighed by their rows).
- **A data-dependent branch** (``model["branch"]`` = {"at", "every"}): samples whose first
  token id divides by ``every`` go through an extra module; the others do not, and when
  none of a batch's samples does the module's parameters are not in the graph at all.
  Under DDP and ZeRO 1-3 some DP ranks then use the parameters and others do not in the
  same step. ``at="block"``: a residual adapter (a square Linear) on the last block's
  output, for the chosen samples only (``index_add`` of the adapter's output on their
  rows), so under ZeRO-3 it belongs to that block's unit; drawn where no plan has TP (a
  plain Linear on a tensor-parallel activation is not a vescale model). ``at="head"``: a
  small head (Linear(4, 1)) on features of the chosen samples' first 4 token ids, whose
  squared output, summed over the chosen samples and divided by the batch's rows, is
  added to the loss; at the root (ZeRO-3's root unit), under TP too. Either way each
  sample's loss depends on that sample alone, and the loss is a mean over the batch's
  rows, so one device running the same rule over the global batch computes exactly the
  rows-weighted mean of the ranks' losses, and the parameters' gradients are None on one
  device exactly when no DP rank used them. Not drawn under a pipeline (the schedule runs
  the model's blocks itself, not its patched forward).
- **Masked prompts** (``loop["prompts"]``): each sample's first m labels are ignored
  (-100; the project's GPT: -1), m drawn per sample from 0 to all of them, as supervised
  fine-tuning masks a prompt; every global batch keeps a target. DP ranks and a
  pipeline's micro-batches then hold different numbers of targets, and one device's loss
  is the mean over the global batch's targets: vescale weighs each mean cross-entropy by
  its targets (``vescale/global_loss.py``, ``pipeline/weights.py``). Not drawn with the
  branch at the head (that loss is not a cross-entropy alone: rows weigh), nor under a
  pipeline with fp16 loss scaling: a schedule starts a micro-batch's backward before the
  batch's targets are all counted, so its fp16 gradients are one device's times the
  first micro-batch's estimate of the total, and an overflow (a skipped step) can come at
  another step than one device's (README, "Not yet so"; seed 140483).
"""

from __future__ import annotations

import random

import torch

EMPTY_BATCH_MODELS = ("gpt",)  # forwards that take a batch of 0 rows (checked on one device)
BLOCKS = {"gpt": "transformer.h", "llama": "model.layers", "hf_llama": "model.layers", "hf_qwen2": "model.layers",
          "hf_gpt2": "transformer.h", "hf_bert": "bert.encoder.layer"}


def _dims(plan: dict) -> tuple[int, int, int]:
    mesh = plan["mesh"]
    return mesh.get("PP", 1), mesh.get("DP", 1), plan.get("pipeline_parallel.microbatches", 1)


def draw(rng: random.Random, setup: dict) -> None:
    """Adds this module's draws to ``setup`` (in place)."""
    loop, model = setup["loop"], setup["model"]
    plans = [setup["plan"]] + ([loop["resume"]["plan"]] if loop["resume"] else [])
    if loop["batch"] > 1 and rng.random() < 0.35:
        least = 1
        if model["kind"] not in EMPTY_BATCH_MODELS:  # every rank a row where no pipeline refuses first
            least = max([1] + [_dims(p)[1] for p in plans if _dims(p)[0] == 1])
        if least < loop["batch"]:
            loop["last"] = rng.randrange(least, loop["batch"])
    if all(_dims(p)[0] == 1 for p in plans) and rng.random() < 0.35:
        at = rng.choice(["block", "head"]) if not any("TP" in p["mesh"] for p in plans) else "head"
        model["branch"] = {"at": at, "every": rng.choice([2, 3])}
    scaled_pipeline = _dims(setup["plan"])[0] > 1 and "mixed_precision.loss_scale" in setup["plan"]
    if model.get("branch", {}).get("at") != "head" and not scaled_pipeline and rng.random() < 0.35:
        loop["prompts"] = True


# ---- masked prompts -------------------------------------------------------------------------------

def ignore_index(setup: dict) -> int:
    return -1 if setup["model"]["kind"] == "gpt" else -100  # (the project's GPT: nanoGPT's -1)


def prompt_lengths(setup: dict, n: int, labels: int, batches: list[torch.Tensor]) -> torch.Tensor | None:
    """Per sample (``n``), how many of its ``labels`` leading labels are masked (None without
    ``loop["prompts"]``): 0 to all of them, all with probability 0.2; then every global
    batch (``batches``: the sample indices of each, as the loop reads them) keeps one
    sample with a target (a label past the first: Hugging Face's causal models shift)."""
    if not setup["loop"].get("prompts"):
        return None
    g = torch.Generator().manual_seed(setup["data_seed"] + 7919)
    lengths = torch.randint(0, labels - 1, (n,), generator=g)
    lengths[torch.rand(n, generator=g) < 0.2] = labels
    for ids in batches:
        if len(ids) and bool((lengths[ids] == labels).all()):
            lengths[ids[0]] = 0
    return lengths


def masked(labels: torch.Tensor, prompt: int, ignore: int) -> torch.Tensor:
    out = labels.clone()
    out[:prompt] = ignore
    return out


# ---- the uneven last batch ------------------------------------------------------------------------

def samples(setup: dict, epoch_batches: int) -> int:
    """The dataset's size: whole global batches, the last of them ``loop["last"]`` rows."""
    loop = setup["loop"]
    return epoch_batches * loop["batch"] - (loop["batch"] - loop["last"] if "last" in loop else 0)


def drop_last(setup: dict) -> bool:
    return "last" not in setup["loop"]


def global_rows(setup: dict) -> list[int]:
    """The rows of each global batch the loop reads (epochs of ``epoch_batches`` batches,
    the last of each ``loop["last"]`` rows with an uneven last batch)."""
    loop, k = setup["loop"], setup["plan"].get("gradient.accumulation_steps", 1)
    epoch = loop.get("data", {}).get("epoch_batches", loop["steps"] * k)
    sizes = [loop["batch"]] * (epoch - 1) + [loop.get("last", loop["batch"])]
    return (sizes * (loop["steps"] * k))[:loop["steps"] * k]


def _plan_at(setup: dict, step: int) -> dict:
    """The plan that runs micro-step ``step`` (the resumed one after the checkpoint)."""
    resume, k = setup["loop"]["resume"], setup["plan"].get("gradient.accumulation_steps", 1)
    return resume["plan"] if resume is not None and step >= resume["after"] * k else setup["plan"]


def refusal_at(setup: dict, batches: list) -> int | None:
    """The first micro-step whose global batch a pipeline refuses (see the module
    docstring), or None: under DP > 1 the DP ranks' rows must be even and at least one
    per micro-batch; under DP 1 the batch must hold a row per micro-batch. ``batches``:
    the global batches, or their numbers of rows."""
    for i, rows in enumerate(batches):
        pp, dp, m = _dims(_plan_at(setup, i))
        if pp == 1:
            continue
        n = rows if isinstance(rows, int) else len(rows)
        split = [len(part) for part in torch.tensor_split(torch.arange(n), dp)]
        if min(split) != max(split) or min(split) < m:
            return i
    return None


REFUSALS = ("under a pipeline, the DP ranks' batches must be even", "cannot be cut into")


def is_expected_refusal(error: Exception) -> bool:
    return isinstance(error, ValueError) and any(r in str(error) for r in REFUSALS)


def rows_of(batch) -> int:
    first = batch["input_ids"] if isinstance(batch, dict) else batch[0]
    return int(first.shape[0])


def rows_weighted_mean(model, loss: torch.Tensor, rows: int) -> float:
    """The mean over the DP ranks of this rank's loss (``predict`` gives each rank its own
    batch's), each weighted by its rows (with masked prompts: its targets) as one device's
    mean over the global batch is: a rank without any (a NaN loss, a mean over nothing)
    counts for nothing."""
    import torch.distributed as dist
    sums = torch.tensor([float(loss.detach().double()) * rows if rows else 0.0, float(rows)], dtype=torch.float64)
    mesh = model.mesh
    if "DP" in (mesh.mesh_dim_names or ()) and mesh.size("DP") > 1:
        dist.all_reduce(sums, group=mesh.get_group("DP"))
    return float(sums[0] / sums[1])


# ---- the data-dependent branch ------------------------------------------------------------------

def add_branch(model: torch.nn.Module, spec: dict, seed: int) -> None:
    """Gives ``model`` the branch of ``spec["branch"]`` (see the module docstring): its
    parameters from their own seed (the global generator left as it was, so that dropout
    draws what it would without them), its forward patched on the instance."""
    branch = spec["branch"]
    at, every, vocab = branch["at"], branch["every"], spec["vocab"]
    with torch.random.fork_rng():
        torch.manual_seed(seed + 7919)
        extra = torch.nn.Linear(spec["width"], spec["width"], bias=False) if at == "block" else torch.nn.Linear(4, 1)
    root_forward = model.forward
    if at == "block":
        block = model.get_submodule(BLOCKS[spec["kind"]])[-1]
        block.branch = extra
        block_forward = block.forward

        def forward_block(*args, **kwargs):
            out = block_forward(*args, **kwargs)
            chosen = model._branch_rows
            if chosen.numel() == 0:  # no sample of this batch: the adapter stays out of the graph
                return out
            h = out[0] if isinstance(out, tuple) else out
            h = h.index_add(0, chosen, block.branch(h.index_select(0, chosen)).to(h.dtype))  # (autocast: bf16)
            return (h, *out[1:]) if isinstance(out, tuple) else h

        block.forward = forward_block
    else:
        model.branch_head = extra

    def forward(*args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        chosen = (ids[:, 0] % every == 0).nonzero().flatten()
        model._branch_rows = chosen
        out = root_forward(*args, **kwargs)
        if at == "block" or chosen.numel() == 0:
            return out
        head = model.branch_head
        feats = ids.index_select(0, chosen)[:, :4].to(head.weight.dtype) / vocab
        term = head(feats).pow(2).sum() / ids.shape[0]  # a mean over the batch's rows, like the loss
        if isinstance(out, torch.Tensor):
            return out + term
        out.loss = out.loss + term
        return out

    model.forward = forward
