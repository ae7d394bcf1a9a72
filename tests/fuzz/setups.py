"""Training set-ups as data: a model, a ``vescale.Plan``, an optimizer and a training loop,
drawn at random over 4 ranks (or another world size), for differential fuzzing of whole
training runs.

The op-chain fuzzer (chains.py) checks the engine one value at a time; what users run
is the composition of everything above it: ``vescale.parallelize`` with a mesh of
pipeline, tensor and data parallelism, ZeRO stages, gradient accumulation, clipping,
parameter groups, LR schedulers, recomputation, evaluation between steps, and a
checkpoint resumed under another plan. A set-up is a plain dict (a literal that a
regression test can hold); ``setup_rank.py`` runs it on the ranks and on one device.

Every drawn set-up is one vescale accepts, as far as the plan's documented rules say
(``vescale/train.py``, ``vescale/plan.py``): a refusal of a drawn set-up is a finding too.
"""

from __future__ import annotations

import copy
import json
import random

from tests.fuzz import rank_differences

WORLD = 4

# Meshes over the 4 ranks, outermost dim first. Dims of one rank are legal and are
# drawn too (a pipeline stage's mesh may have them). Other worlds: meshes_of(world).
MESHES = [
    {"DP": 4}, {"TP": 4}, {"PP": 4},
    {"DP": 2, "TP": 2}, {"TP": 2, "DP": 2},
    {"PP": 2, "TP": 2}, {"TP": 2, "PP": 2},
    {"PP": 2, "DP": 2}, {"DP": 2, "PP": 2},
    {"PP": 2, "DP": 1, "TP": 2}, {"DP": 1, "TP": 4}, {"PP": 1, "DP": 4},
]

MODELS = ("gpt", "llama", "hf_llama", "hf_gpt2", "hf_qwen2", "hf_bert")
OPTIMIZERS = ("sgd", "sgd_momentum", "adamw", "adamw_groups", "adam_fused")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def meshes_of(world: int) -> list[dict]:
    """Every mesh of PP, DP and TP over ``world`` ranks (outermost first, PP outside DP
    outside TP, or DP and TP swapped), dims of one rank left out. ``MESHES`` for 4."""
    if world == WORLD:
        return MESHES
    out = []
    for pp in range(1, world + 1):
        for tp in range(1, world // pp + 1):
            if world % (pp * tp):
                continue
            dp = world // (pp * tp)
            sizes = {"PP": pp, "DP": dp, "TP": tp}
            for order in (("PP", "DP", "TP"), ("PP", "TP", "DP")):
                mesh = {d: sizes[d] for d in order if sizes[d] > 1} or {"DP": 1}
                if mesh not in out:
                    out.append(mesh)
    return out


def _head_counts(world: int) -> tuple[list[int], list[int]]:
    """Attention heads, and key/value head counts, that every TP size of ``world`` can
    split (query heads divide by TP; key/value heads divide by it or it by them)."""
    if world == WORLD:
        return [2, 4], []
    tps = [t for t in range(2, world + 1) if world % t == 0]
    heads = [h for h in (2, 3, 4, 6, 8, 12) if all(h % t == 0 for t in tps)][:2]
    kv = [k for k in range(1, max(heads) + 1) if all(k % t == 0 or t % k == 0 for t in tps)]
    return heads, kv


def draw(rng: random.Random, world: int = WORLD) -> dict:
    """One set-up over ``world`` ranks (see the module docstring)."""
    meshes = meshes_of(world)
    mesh = dict(rng.choice(meshes))
    pp, tp, dp = mesh.get("PP", 1), mesh.get("TP", 1), mesh.get("DP", 1)
    kind = rng.choice(MODELS)
    head_counts, kv_counts = _head_counts(world)
    heads = rng.choice(head_counts)
    width = heads * rng.choice([4, 6, 8])
    model = {"kind": kind, "width": width, "heads": heads, "vocab": rng.choice([48, 64, 70]),
             "layers": rng.randint(1, 4)}
    if kind == "gpt":
        model["bias"] = rng.random() < 0.5
    # (key/value projections of fewer rows than TP ranks would leave some empty: refused)
    kv_choices = [h for h in (kv_counts or (1, 2, heads)) if heads % h == 0 and h * (width // heads) >= world]
    if kind in ("hf_llama", "hf_qwen2"):
        model["tied"] = rng.random() < 0.3
        model["kv_heads"] = rng.choice(kv_choices)
    if kind == "llama":
        model["kv_heads"] = rng.choice(kv_choices)

    plan: dict = {"mesh": mesh}
    if "TP" in mesh:
        plan["tensor_parallel.sequence_parallel"] = rng.random() < 0.5
    if "DP" in mesh:
        plan["data_parallel.zero_stage"] = rng.choice([0, 0, 1, 2, 3])
        if rng.random() < 0.2:
            plan["data_parallel.bucket_cap_mb"] = 0.001  # a bucket per parameter or so
    micro = 1
    if pp > 1:
        schedule = rng.choice(SCHEDULES)
        virtual = 2 if schedule == "zbv" else rng.choice([2, 3]) if schedule == "interleaved_1f1b" else 1
        micro = rng.choice([1, 2, 4])
        if schedule == "interleaved_1f1b":
            micro = pp * rng.choice([1, 2])  # Megatron's order: a multiple of the stages
        model["layers"] = max(model["layers"], pp * virtual + rng.randint(0, 2))
        plan.update({"pipeline_parallel.schedule": schedule, "pipeline_parallel.virtual_stages": virtual,
                     "pipeline_parallel.microbatches": micro,
                     "pipeline_parallel.split_method": rng.choice(["uniform", "uniform", "parameters", "flops", "time"])})
    accumulation = 1
    if pp == 1:
        accumulation = rng.choice([1, 1, 2])
        if accumulation > 1:
            plan["gradient.accumulation_steps"] = accumulation
        if rng.random() < 0.25:
            plan["recompute.modules"] = [_blocks_regex(kind) + (r"\.\d+" if rng.random() < 0.5 else r"\.0")]
    if rng.random() < 0.4:
        plan["gradient.clip_norm"] = rng.choice([1.0, 0.05])  # 0.05 clips every step

    optimizer = {"kind": rng.choice(OPTIMIZERS)}
    if rng.random() < 0.3:
        optimizer["weight_decay"] = 0.1
    batch = dp * micro * rng.choice([1, 2])
    loop = {"steps": rng.choice([2, 3]), "seq": rng.choice([8, 12]), "batch": batch,
            "scheduler": rng.choice([None, None, "step", "lambda"]),
            "eval_after": rng.choice([None, None, 0]) if pp == 1 else None, "resume": None}
    if rng.random() < 0.5:  # shuffled, and epochs of one or two global batches (the loop crosses them)
        loop["data"] = {"shuffle": True, "seed": rng.randrange(100), "epoch_batches": rng.choice([1, 2])}
    if rng.random() < 0.3:
        other = draw_resume_plan(rng, model, batch, pipeline=accumulation == 1, meshes=meshes)
        if other is not None:
            loop["resume"] = {"after": 1, "plan": other}
    if plan.get("data_parallel.zero_stage", 0) and loop["resume"] is None and rng.random() < 0.25:
        plan["mixed_precision.param_dtype"] = "bfloat16"  # fp32 masters in the ZeRO optimizer
    if rng.random() < 0.3:
        model["deferred"] = True  # vescale.deferred_init: materialised into the shards
    other = loop["resume"]["plan"]["mesh"] if loop["resume"] else {}
    if (kind in ("gpt", "hf_gpt2", "hf_bert") and dp == 1 and pp == 1 and other.get("DP", 1) == 1 and other.get("PP", 1) == 1
            and rng.random() < 0.5):
        # Dropout draws the masks one device would (the same generator, in the same
        # order) only where every rank sees the whole batch: no data parallelism, no
        # pipeline micro-batches.
        model["dropout"] = 0.2
    setup = {"model": model, "plan": plan, "optimizer": optimizer, "loop": loop,
             "init_seed": rng.randrange(1000), "data_seed": rng.randrange(1000)}
    # Drawn last, so that every seed drawn before autocast was keeps its set-up.
    if "mixed_precision.param_dtype" not in plan and rng.random() < 0.2:
        loop["autocast"] = "bfloat16"  # fp32 parameters, the forward under CPU autocast (both sides)
    if (plan.get("data_parallel.zero_stage", 0) and pp == 1 and loop["resume"] is None
            and "mixed_precision.param_dtype" not in plan and "autocast" not in loop and rng.random() < 0.25):
        # fp16 parameters need loss scaling; vescale's is dynamic (2^16 first, halved on an
        # overflow, which skips the step on every rank) and lives in the ZeRO optimizer
        plan.update({"mixed_precision.param_dtype": "float16", "mixed_precision.loss_scale": "dynamic"})
    if pp > 1 and rng.random() < 0.4:
        loop["eval_after"] = 0  # evaluation through the pipeline: the schedule's forward passes only
    if pp > 1 and plan["pipeline_parallel.schedule"] not in ("zb_h1", "zbv") and rng.random() < 0.25:
        # recomputation under a pipeline (the zero-bubble schedules refuse it)
        plan["recompute.modules"] = [_blocks_regex(kind) + (r"\.\d+" if rng.random() < 0.5 else r"\.0")]
    if (pp > 1 and plan.get("data_parallel.zero_stage", 0) and loop["resume"] is None
            and "mixed_precision.param_dtype" not in plan and "autocast" not in loop and rng.random() < 0.25):
        # fp16 loss scaling under a pipeline: each micro-batch's loss scaled, its gradient a share
        plan.update({"mixed_precision.param_dtype": "float16", "mixed_precision.loss_scale": "dynamic"})
    if rng.random() < 0.2:
        # the model's own activation checkpointing (torch.utils.checkpoint around every block,
        # or Hugging Face's gradient_checkpointing_enable), beside or inside vescale's
        model["checkpointing"] = rng.choice(["reentrant", "non_reentrant"])
    # Drawn last of all: what differs between the ranks (an uneven last batch, a branch
    # some DP ranks take and others do not); rank_differences.py says how.
    rank_differences.draw(rng, setup)
    # After it (every earlier draw of a seed stays as it was): parameters that do not train,
    # as in fine-tuning: frozen before parallelize, or left out of the script's optimizer
    if rng.random() < 0.2:
        # (a pipeline refuses frozen embeddings under reentrant checkpointing: the first
        # stage's result does not require grad, and nothing would cross the cut)
        pipelines = pp > 1 or (loop["resume"] is not None and loop["resume"]["plan"]["mesh"].get("PP", 1) > 1)
        refused = pipelines and model.get("checkpointing") == "reentrant"
        model["frozen"] = rng.choice(["norms", "first_block"] if refused else ["embeddings", "norms", "first_block"])
    if rng.random() < 0.1:
        optimizer["only"] = _blocks_regex(kind)  # the blocks' parameters; the others get gradients, no step
    # After those: the loop edits the parameters between two steps (it rescales the norms'
    # weights; inside optimizer.full_parameters(), where ZeRO-3's are whole)
    if rng.random() < 0.15:
        loop["edit"] = {"before_step": rng.randrange(1, loop["steps"])}
    return setup


def draw_resume_plan(rng: random.Random, model: dict, batch: int, pipeline: bool,
                     meshes: list[dict] = MESHES) -> dict | None:
    """A second plan to resume the checkpoint under, that divides the same global batch
    and fits the model's layers (no pipeline when ``pipeline`` is False: the run
    accumulates gradients); None when none of a few draws does."""
    for _ in range(10):
        mesh = dict(rng.choice([m for m in meshes if pipeline or m.get("PP", 1) == 1]))
        pp, dp = mesh.get("PP", 1), mesh.get("DP", 1)
        plan: dict = {"mesh": mesh}
        if "TP" in mesh:
            plan["tensor_parallel.sequence_parallel"] = rng.random() < 0.5
        if "DP" in mesh:
            plan["data_parallel.zero_stage"] = rng.choice([0, 1, 2, 3])
        micro = 1
        if pp > 1:
            micro = rng.choice([m for m in (1, 2, 4) if batch % (dp * m) == 0] or [0])
            if micro == 0 or model["layers"] < pp:
                continue
            plan.update({"pipeline_parallel.schedule": rng.choice(["gpipe", "1f1b", "zb_h1"]),
                         "pipeline_parallel.microbatches": micro})
        if batch % (dp * micro):
            continue
        return plan
    return None


def _blocks_regex(kind: str) -> str:
    return {"gpt": r"transformer\.h", "llama": r"model\.layers", "hf_llama": r"model\.layers",
            "hf_qwen2": r"model\.layers", "hf_gpt2": r"transformer\.h", "hf_bert": r"bert\.encoder\.layer"}[kind]


def describe(setup: dict) -> str:
    return json.dumps(setup, sort_keys=True)


# ---- shrinking: set-ups that keep less of the original --------------------------------------------

def simpler(setup: dict):
    """Set-ups with one feature of ``setup`` taken away or made plainer, most drastic first."""
    def variant(change):
        s = copy.deepcopy(setup)
        change(s)
        return s if s != setup else None

    loop, plan, model = setup["loop"], setup["plan"], setup["model"]
    changes = []
    for key in ("deferred", "dropout", "checkpointing", "branch", "frozen"):
        if key in model:
            changes.append(lambda s, k=key: s["model"].pop(k))
    if loop["resume"] is not None:
        changes.append(lambda s: s["loop"].update(resume=None))
    if loop["eval_after"] is not None:
        changes.append(lambda s: s["loop"].update(eval_after=None))
    if loop["scheduler"] is not None:
        changes.append(lambda s: s["loop"].update(scheduler=None))
    for key in ("data", "autocast", "last", "prompts", "edit"):
        if key in loop:
            changes.append(lambda s, k=key: s["loop"].pop(k))
    if loop["steps"] > 1:
        changes.append(lambda s: s["loop"].update(steps=s["loop"]["steps"] - 1))
    for key, plain in (("mixed_precision.param_dtype", None), ("mixed_precision.loss_scale", None),
                       ("gradient.clip_norm", None), ("recompute.modules", None), ("gradient.accumulation_steps", None),
                       ("data_parallel.bucket_cap_mb", None), ("tensor_parallel.sequence_parallel", False),
                       ("data_parallel.zero_stage", 0), ("pipeline_parallel.split_method", "uniform"),
                       ("pipeline_parallel.schedule", "1f1b")):
        if key in plan and plan[key] != plain:
            if key == "pipeline_parallel.schedule":
                def to_1f1b(s):
                    s["plan"].update({"pipeline_parallel.schedule": "1f1b", "pipeline_parallel.virtual_stages": 1})
                changes.append(to_1f1b)
            else:
                changes.append(lambda s, k=key, v=plain: s["plan"].pop(k) if v is None else s["plan"].update({k: v}))
    if setup["optimizer"] != {"kind": "sgd"}:
        changes.append(lambda s: s.update(optimizer={"kind": "sgd"}))
    if model["layers"] > 1:
        changes.append(lambda s: s["model"].update(layers=s["model"]["layers"] - 1))
    for candidate in (variant(c) for c in changes):
        if candidate is not None and valid(candidate):
            yield candidate


def valid(setup: dict) -> bool:
    """What ``draw`` guarantees, checked again after shrinking."""
    plan, model, loop = setup["plan"], setup["model"], setup["loop"]
    mesh = plan["mesh"]
    pp, dp = mesh.get("PP", 1), mesh.get("DP", 1)
    micro = plan.get("pipeline_parallel.microbatches", 1)
    virtual = plan.get("pipeline_parallel.virtual_stages", 1)
    if loop["batch"] % (dp * micro):
        return False
    if loop["resume"] is not None and model["layers"] < loop["resume"]["plan"]["mesh"].get("PP", 1):
        return False  # (the resumed plan's pipeline needs a block per stage, as draw_resume_plan asks)
    return pp == 1 or model["layers"] >= pp * virtual
