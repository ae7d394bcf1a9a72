"""Checkpoints of pipeline-parallel training keep layout-free keys: a model and its AdamW
state saved under PP2 x TP2 (and DP2 x PP2 with ZeRO-1) load into TP4 without a
pipeline, PP4, a plain model in every process (and in a process without
torch.distributed), PP2 x TP2 again, and DP2 x PP2 with and without ZeRO-1. After
the load every tensor (parameters and optimizer state) is bitwise the saved one, and
the next step's loss is that of the original run continued and of a single-device run
(fp32, rtol 1e-5). The checkpoint holds a tied weight once (the second name is an
alias) and every element of every tensor once, under the keys a single-device save
uses. The Hugging Face export of a pipeline holds every weight once and imports into
another split. Also: a vescale.deferred_init model cut into stages materialises only
this rank's stages, trains as a normally built one, and takes its values from a
checkpoint without running its initialisation.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.boxes import Box, whole
from vescale.checkpoint.layout import build
from vescale.deferred import is_deferred
from vescale.parallel import DDP, DistributedOptimizer, PipelineParallel, parallelize_module
from vescale.parallel.pipeline import is_elsewhere

from dist_utils import mismatch
from test_models import MODELS as TP_PLANS
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM

# four blocks (PP4 needs one per stage); GPT's vocabulary of 66 splits 17/17/17/15 under TP4
FACTORIES = {
    "gpt": (GPT, GPTConfig(vocab_size=66, n_embd=36, n_head=6, n_layer=4, bias=False)),
    "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=66, num_hidden_layers=4)),
}
TIED = {"gpt": {"model.lm_head.weight": "model.transformer.wte.weight"}, "llama": {}}
BATCH, SEQ, STEPS_BEFORE, LR = 8, 16, 2, 1e-2

# layout: (mesh shape, dim names, pipeline?, tensor-parallel dim, data-parallel dim, ZeRO stage)
LAYOUTS = {
    "pp2_tp2": ((2, 2), ("PP", "TP"), True, "TP", None, 0),
    "tp4": ((4,), ("TP",), False, "TP", None, 0),
    "pp4": ((4,), ("PP",), True, None, None, 0),
    "plain": (None, None, False, None, None, 0),
    "dp2_pp2": ((2, 2), ("DP", "PP"), True, None, "DP", 0),
    "dp2_pp2_zero1": ((2, 2), ("DP", "PP"), True, None, "DP", 1),
}

_meshes: dict = {}


def _mesh(shape, names):
    if (shape, names) not in _meshes:  # once per rank: a mesh makes process groups
        _meshes[shape, names] = vescale.init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape, names]


def _model(name: str, deferred: bool = False) -> torch.nn.Module:
    cls, config = FACTORIES[name]
    return vescale.deferred_init(cls, config) if deferred else cls(config)


def _plan(name: str) -> dict:
    """test_models' Megatron placements, one per dim of mesh["TP"]."""
    return {"parameter": {pattern: [p] for pattern, p in TP_PLANS[name][1].items()}}


def _batches(name: str):
    g = torch.Generator().manual_seed(5)
    vocab = FACTORIES[name][1].vocab_size
    data = [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS_BEFORE + 1)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


class _Run:
    """``layout`` of the model; with ``bind``, a deferred model takes its values from
    that checkpoint before tensor parallelism shards it (its initialisation never runs)."""

    built = False

    def __init__(self, name: str, layout: str, seed: int, *, deferred: bool = False, bind: str | None = None):
        shape, names, pipeline, tp_dim, dp_dim, zero = LAYOUTS[layout]
        torch.manual_seed(seed)
        model = _model(name, deferred)
        _Run.built = True  # from here on, random initialisation counts as such (recording also draws)
        m = _mesh(shape, names) if shape is not None else None
        self.pipe = PipelineParallel(model, m, split="uniform", schedule="1f1b", microbatches=4) if pipeline else None
        self.after_pipeline = _kinds(model)
        if bind is not None:  # the model only: the optimizer is made after parallelize_module
            vescale.load(bind, {"model": self.pipe or model}, strict=False)
        if tp_dim is not None:
            parallelize_module(model, m[tp_dim] if len(shape) > 1 else m, _plan(name))
        self.raw = model
        self.model = self.pipe if pipeline else model
        self.dp, self.rows = None, slice(None)
        if dp_dim is not None:
            self.dp = m[dp_dim]
            local = BATCH // self.dp.size()
            self.rows = slice(self.dp.get_local_rank() * local, (self.dp.get_local_rank() + 1) * local)
            self.model = DDP(self.model, self.dp)
        if zero:
            self.opt = DistributedOptimizer(torch.optim.AdamW, models=[self.model], zero_stage=zero, lr=LR,
                                            weight_decay=0.1)
        else:  # a pipeline's parameters(): this rank's only
            self.opt = torch.optim.AdamW((self.pipe or model).parameters(), lr=LR, weight_decay=0.1)

    def state(self) -> dict:
        return {"model": self.model, "optimizer": self.opt}

    def step(self, idx, tgt) -> float:
        self.opt.zero_grad()
        idx, tgt = idx[self.rows], tgt[self.rows]
        if self.pipe is not None:
            loss = self.pipe.step(idx, tgt).clone()
        else:
            loss = self.model(idx, tgt)
            loss.backward()
            loss = loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss.detach().clone()
        self.opt.step()
        if self.dp is not None:
            dist.all_reduce(loss, group=self.dp.get_group())
            loss /= self.dp.size()
        return loss.item()


def _kinds(model: torch.nn.Module) -> dict[str, str]:
    """What each parameter and buffer of the (unwrapped) model is on this rank now."""
    from vescale.parallel.ddp import local_of

    out = {}
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        local = local_of(t.detach())
        kind = "deferred" if is_deferred(local) else "meta" if local.is_meta else "real"
        out[n] = "elsewhere" if is_elsewhere(t) and kind == "meta" else f"elsewhere but {kind}" if is_elsewhere(t) \
            else kind
    return out


def _global_state(state: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of ``state`` by its checkpoint key, whole, assembled from every
    rank's pieces; and where holders of the same elements disagree."""
    mine = {k: (i.shape, i.dtype, [(p.box, p.tensor.detach().clone()) for p in i.pieces])
            for k, i in build(state).items.items()}
    everyone: list = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    out, disagree = {}, []
    for held in everyone:
        for key, (shape, dtype, pieces) in held.items():
            if key not in out:
                out[key] = torch.full(shape, float("nan"), dtype=dtype) if dtype.is_floating_point else \
                    torch.zeros(shape, dtype=dtype)
            for box, t in pieces:
                view = box.view_of(out[key], whole(shape))
                if not torch.isnan(view).all() and not torch.equal(view, t):
                    disagree.append(key)
                view.copy_(t)
    return out, disagree


def _compare(now: dict, saved: dict) -> list[str]:
    # ZeRO's fp32 master weights, optional in a checkpoint: the parameters' values
    now, saved = dict(now), dict(saved)
    masters = {k: now.pop(k) for k in list(now) if k.startswith("optimizer.master.")}
    saved = {k: v for k, v in saved.items() if not k.startswith("optimizer.master.")}
    failures = [f"{k}: not the loaded parameter" for k, v in masters.items()
                if not torch.equal(v, saved[k[len("optimizer.master."):]])]
    failures += [f"{k}: missing after the load" for k in saved if k not in now]
    failures += [f"{k}: not in the checkpoint" for k in now if k not in saved]
    failures += [f"{k}: not bitwise equal to the saved tensor" for k in saved
                 if k in now and not torch.equal(now[k], saved[k])]
    return failures


def _case_save(name: str, layout: str, path: str) -> tuple[list[float], float, list[str]]:
    run = _Run(name, layout, seed=0)
    batches = _batches(name)
    losses = [run.step(*b) for b in batches[:STEPS_BEFORE]]
    vescale.save(path, run.state())
    vescale.checkpoint.export_hf(path + "-hf", run.model, max_shard_size="40KB")
    saved, disagree = _global_state(run.state())
    if dist.get_rank() == 0:
        torch.save(saved, path + ".state.pt")
    dist.barrier()
    return losses, run.step(*batches[STEPS_BEFORE]), disagree


def _case_resume(name: str, target: str, path: str) -> tuple[list[str], float]:
    """Loads into ``target``: a layout, or ``<layout>_deferred`` (a vescale.deferred_init
    model, loaded after parallelize_module), or ``<layout>_bound`` (deferred, loaded
    before parallelize_module: no random initialisation may run)."""
    import vescale.deferred as di

    layout, _, how = target.partition("_deferred")
    streams = []
    real_stream = di.stream

    def counted(*args, **kwargs):  # random initialisations of materialised tensors
        if _Run.built:
            streams.append(1)
        return real_stream(*args, **kwargs)

    di.stream, _Run.built = counted, False
    try:
        # other initial values (seed 1): everything must come from the checkpoint
        run = _Run(name, layout, seed=1, deferred=bool(target != layout), bind=path if how == "_bound" else None)
        vescale.load(path, run.state())
        vescale.materialize_module(run.raw)  # a deferred model: the rest of this rank's tensors
    finally:
        di.stream = real_stream
    now, disagree = _global_state(run.state())
    failures = _compare(now, torch.load(path + ".state.pt")) + [f"{k}: holders disagree" for k in disagree]
    if how == "_bound" and streams:
        failures.append(f"{len(streams)} random initialisations ran although the checkpoint had the values")
    kinds = _kinds(run.raw)
    failures += [f"{n} is {k} on this rank" for n, k in kinds.items() if k not in ("real", "elsewhere")]
    if not LAYOUTS[layout][2] and "elsewhere" in kinds.values():
        failures.append("a tensor is elsewhere without a pipeline")
    return failures, run.step(*_batches(name)[STEPS_BEFORE])


def _case_import_hf(name: str, layout: str, path: str) -> list[str]:
    """The Hugging Face export of the saved run imported into ``layout``."""
    run = _Run(name, layout, seed=1)
    vescale.checkpoint.import_hf(path + "-hf", run.model)
    now, disagree = _global_state({"model": run.model})
    saved = {k: v for k, v in torch.load(path + ".state.pt").items() if k.startswith("model.")}
    return _compare(now, saved) + [f"{k}: holders disagree" for k in disagree]


def _reference(name: str) -> tuple[list[float], tuple]:
    """Single-device losses of every step, and the keys and the optimizer's parameter
    groups (parameter keys) that a single-device save has."""
    torch.manual_seed(0)
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for idx, tgt in _batches(name):
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    layout = build({"model": model, "optimizer": opt})
    return losses, (sorted(layout.items), [g["params"] for g in layout.objects["optimizer.param_groups"]])


def _check_manifest(path: str, name: str, single: tuple) -> list[str]:
    """The checkpoint has the keys and parameter groups of a single-device save, a tied
    weight once (its second name an alias), and every element of every tensor once."""
    keys, groups = single
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    saved_groups = json.load(open(os.path.join(path, "objects.json")))["values"]["optimizer.param_groups"]
    failures = []
    if [sorted(g["params"]) for g in saved_groups] != [sorted(g) for g in groups]:  # ZeRO lists them by bucket
        failures.append(f"parameter groups {[g['params'] for g in saved_groups]}, single-device {groups}")
    if manifest["aliases"] != TIED[name]:
        failures.append(f"aliases {manifest['aliases']}, expected {TIED[name]}")
    required = sorted(k for k, v in manifest["tensors"].items() if not v["optional"])
    if required != keys:
        failures.append(f"keys {sorted(set(required) ^ set(keys))} differ from a single-device save's")
    masters = sorted(k for k, v in manifest["tensors"].items() if v["optional"])
    if masters and masters != sorted(f"optimizer.master.{k}" for k in keys if k.startswith("model.")):
        failures.append(f"ZeRO master weights {masters}")
    for key, entry in manifest["tensors"].items():
        boxes = [Box.from_json(c["box"]) for c in entry["chunks"]]
        overlapping = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.intersect(b) is not None]
        if overlapping or sum(b.numel() for b in boxes) != math.prod(entry["shape"]):
            failures.append(f"{key}: chunks {boxes} do not hold each element once")
    return failures


def _safetensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    return {k: v for f in sorted(set(index["weight_map"].values())) for k, v in
            load_file(os.path.join(directory, f)).items()}


LOADS = ["tp4", "pp4", "plain", "pp2_tp2", "pp2_tp2_deferred", "pp2_tp2_deferred_bound", "dp2_pp2", "dp2_pp2_zero1"]


SAVES = [("gpt", "pp2_tp2"), ("llama", "pp2_tp2"), ("gpt", "dp2_pp2_zero1")]


@pytest.mark.parametrize("name,source", SAVES, ids=[f"{n}-{s}" for n, s in SAVES])
def test_pipeline_checkpoint_loads_into_other_layouts(pool4, tmp_path, name, source):
    path = str(tmp_path / "ckpt")
    ref, single = _reference(name)
    answers = pool4.run(_case_save, name, source, path)
    before, continued, disagree = answers[0]
    assert all(a[:2] == (before, continued) for a in answers), answers
    assert all(a[2] == [] for a in answers), f"holders of the same elements disagree: {answers}"
    err = mismatch(torch.tensor(before + [continued]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert err is None, f"{source} losses {before + [continued]} vs single-device {ref}: {err}"
    assert _check_manifest(path, name, single) == []
    exported = _safetensors(path + "-hf")
    assert sorted(exported) == [k[len("model."):] for k in single[0] if k.startswith("model.")]  # tied: once
    saved = torch.load(path + ".state.pt")
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in exported.items())
    assert pool4.run(_case_import_hf, name, "pp4", path) == [[]] * 4
    answers = {target: pool4.run(_case_resume, name, target, path) for target in LOADS}
    answers["single process"] = [_case_resume(name, "plain", path)]  # here, without torch.distributed
    for target, per_rank in answers.items():
        for failures, loss in per_rank:
            assert failures == [], f"{target}: {failures}"
            for expected in (continued, ref[STEPS_BEFORE]):
                assert mismatch(torch.tensor(loss), torch.tensor(expected), rtol=1e-5, atol=1e-6) is None, \
                    f"{target}: next loss {loss}, continued {source} {continued}, single-device {ref[STEPS_BEFORE]}"


# ---- vescale.deferred_init cut into stages --------------------------------------------------

def _case_deferred_training(name: str, layout: str) -> tuple[list[str], list[float], list[float]]:
    """A deferred model and a normally built one (same seed), cut into stages and trained;
    returns what is wrong with the deferred one's tensors, and both runs' losses."""
    batches = _batches(name)
    normal = _Run(name, layout, seed=0)
    expected = [normal.step(*b) for b in batches]
    run = _Run(name, layout, seed=0, deferred=True)
    failures = [f"after PipelineParallel, {n} is {k}" for n, k in run.after_pipeline.items()
                if k not in ("deferred", "elsewhere")]  # nothing materialised yet, no other stage's tensor deferred
    if "elsewhere" not in run.after_pipeline.values() or "deferred" not in run.after_pipeline.values():
        failures.append(f"expected deferred and other stages' tensors on every rank: {run.after_pipeline}")
    losses = [run.step(*b) for b in batches]
    kinds = _kinds(run.raw)  # this rank's tensors materialised, the other stages' still meta
    failures += [f"after training, {n} is {k}" for n, k in kinds.items() if k != run.after_pipeline[n].replace(
        "deferred", "real")]
    return failures, losses, expected


@pytest.mark.parametrize("layout", ["pp2_tp2", "pp4"])
def test_deferred_init_materialises_only_this_ranks_stages(pool4, layout):
    ref, _ = _reference("gpt")
    for failures, losses, normal in pool4.run(_case_deferred_training, "gpt", layout):
        assert failures == []
        assert mismatch(torch.tensor(losses), torch.tensor(normal), rtol=1e-5, atol=1e-6) is None, (losses, normal)
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
