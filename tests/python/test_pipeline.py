"""Pipeline parallelism of unmodified models against single-device training.

Every case trains the same model from the same initial values on one device and under
a pipeline layout (PP alone, PP x TP with and without sequence parallelism, PP x DP
with DDP and ZeRO), with every schedule: losses of each AdamW step (rtol 1e-5) and the
first step's gradients (max error <= 1e-5 of the tensor's largest element) must agree.
Adam-updated parameters are not compared tightly (see dist_utils)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vescale
from vescale.parallel import DDP, DistributedOptimizer, PipelineParallel, PipelineSplitError, parallelize_module
from vescale.parallel.pipeline import analytic_bubble, make_schedule, simulate
from vescale.parallel.plans import gpt_plan, llama_plan

from dist_utils import full_grads, mismatch, training_mismatches
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM

LR = 1e-2
_meshes: dict = {}


def _mesh(shape, names) -> vescale.DeviceMesh:
    key = (tuple(shape), tuple(names))
    if key not in _meshes:
        _meshes[key] = vescale.DeviceMesh("cpu", torch.arange(4).reshape(shape), mesh_dim_names=names)
    return _meshes[key]


# ---- models ----------------------------------------------------------------------------------

def _gpt(layers: int = 4):
    return GPT(GPTConfig(n_layer=layers, dropout=0.0, bias=False))


def _llama(layers: int = 4):
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers))


def _hf(kind: str, layers: int):
    import transformers as tf
    if kind == "qwen3":  # tied embeddings
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True))
    if kind == "gpt2":  # tied embeddings, Conv1D layers
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=layers, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    raise ValueError(kind)


_HF_TP = {"parameter": {r".*(q|k|v)_proj\.weight": [vescale.Shard(0)], r".*o_proj\.weight": [vescale.Shard(1)],
                        r".*(gate|up)_proj\.weight": [vescale.Shard(0)], r".*down_proj\.weight": [vescale.Shard(1)]}}


class _GlueParams(nn.Module):
    """Parameters held by the model itself, used by its forward's own code before and after
    the blocks: every stage holds them and their gradients are summed."""

    def __init__(self, layers: int):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.pos = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(layers)])
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 64)

    def forward(self, x, y):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h * self.scale).flatten(0, 1), y.flatten())


def _build(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "glue":
        return _GlueParams(layers)
    if kind == "gpt":
        return _gpt(layers)
    if kind == "llama":
        return _llama(layers)
    return _hf(kind.removeprefix("hf_"), layers)


def _batches(steps: int, batch: int = 8, seqs=(16,)):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(steps):
        d = torch.randint(0, 64, (batch, seqs[i % len(seqs)] + 1), generator=g)
        out.append((d[:, :-1].contiguous(), d[:, 1:].contiguous()))
    return out


def _loss(model, kind, x, y):
    if kind.startswith("hf_"):
        return model(input_ids=x, labels=x, use_cache=False).loss
    return model(x, y)


def _reference(kind: str, layers: int, batches, accumulate: int = 1):
    model = _build(kind, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for x, y in batches:
        opt.zero_grad()
        loss = 0.0
        for xa, ya in zip(x.chunk(accumulate), y.chunk(accumulate)):
            part = _loss(model, kind, xa, ya)
            part.backward()
            loss += part.item() / accumulate
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss)
    return losses, grads


# ---- one parity case -------------------------------------------------------------------------

def _case(kind: str, layers: int, shape, names, schedule: str, microbatches: int, virtual: int = 1,
          split="uniform", tp: str | None = None, zero: int | None = None, seqs=(16,), steps: int = 5,
          accumulate: int = 1):
    m = _mesh(shape, names)
    batches = _batches(steps, seqs=seqs)
    model = _build(kind, layers)
    pipe = PipelineParallel(model, m, split=split, schedule=schedule, microbatches=microbatches,
                            virtual_stages=virtual)
    if tp is not None:
        plan = {"gpt": gpt_plan, "llama": llama_plan}[kind](sequence_parallel=tp == "sp") if kind in ("gpt", "llama") \
            else _HF_TP
        parallelize_module(model, m["TP"], plan)
    wrapped = pipe
    if "DP" in names:
        wrapped = DDP(pipe, m["DP"])
    if zero is not None:
        opt = DistributedOptimizer(torch.optim.AdamW, [wrapped], zero_stage=zero, lr=LR)
    else:
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, grads = [], None
    dp = m.size("DP") if "DP" in names else 1
    for x, y in batches:
        if dp > 1:  # each DP rank trains its slice of the batch
            r = m.get_local_rank("DP")
            x, y = x.chunk(dp)[r], y.chunk(dp)[r]
        opt.zero_grad()
        loss = torch.zeros((), dtype=torch.float64)
        for i, (xa, ya) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            # gradient accumulation: DDP reduces at the last step only
            with wrapped.no_sync() if i < accumulate - 1 and wrapped is not pipe else contextlib.nullcontext():
                if kind.startswith("hf_"):
                    loss += pipe.step(input_ids=xa, labels=xa) / accumulate  # use_cache at its default (True)
                else:
                    loss += pipe.step(xa, ya) / accumulate
        if grads is None:
            grads = full_grads(wrapped)
        opt.step()
        if dp > 1:  # the batch loss: the mean of the DP ranks' losses
            torch.distributed.all_reduce(loss, group=m.get_group("DP"))
            loss /= dp
        losses.append(loss.item())
    ref_losses, ref_grads = _reference(kind, layers, batches, accumulate)
    failures = []
    failures += training_mismatches(losses, ref_losses, grads, ref_grads)
    if pipe.local_stages == [0] and virtual == 1:  # one header per micro-batch shape, then payloads only
        shapes = {tuple(c.shape) for x, _ in batches for c in torch.tensor_split(x.chunk(dp)[0].chunk(accumulate)[0], microbatches)}
        if pipe.boundary.headers_sent != len(shapes):
            failures.append(f"{pipe.boundary.headers_sent} headers sent for {len(shapes)} micro-batch shapes")
    owned = {n for n, _ in pipe.named_parameters()}
    if not owned or owned == set(ref_grads):
        failures.append(f"this rank holds {len(owned)} of {len(ref_grads)} parameters; a stage holds a part")
    for name, p in model.named_parameters():
        if name not in owned and not p.is_meta:
            failures.append(f"{name} belongs to another stage but is materialised here")
    return failures


CASES = {
    # name: (model, layers, mesh shape, names, schedule, micro-batches, virtual stages, extra)
    "gpt-pp4-1f1b": ("gpt", 4, (4,), ("PP",), "1f1b", 4, 1, {}),
    "gpt-pp4-gpipe": ("gpt", 4, (4,), ("PP",), "gpipe", 4, 1, {}),
    "gpt-pp4-zb_h1": ("gpt", 4, (4,), ("PP",), "zb_h1", 8, 1, {}),
    "gpt-pp2x2-dp2-interleaved": ("gpt", 4, (2, 2), ("PP", "DP"), "interleaved_1f1b", 4, 2, {}),
    "gpt-pp2-dp2-1f1b": ("gpt", 4, (2, 2), ("PP", "DP"), "1f1b", 2, 1, {}),
    "gpt-pp2-dp2-zero1": ("gpt", 4, (2, 2), ("PP", "DP"), "1f1b", 2, 1, {"zero": 1}),
    "gpt-pp2-dp2-zero2-zb": ("gpt", 4, (2, 2), ("PP", "DP"), "zb_h1", 2, 1, {"zero": 2}),
    "gpt-pp2-dp2-zero3": ("gpt", 4, (2, 2), ("PP", "DP"), "1f1b", 2, 1, {"zero": 3}),
    "gpt-pp2-tp2-1f1b": ("gpt", 4, (2, 2), ("PP", "TP"), "1f1b", 4, 1, {"tp": "tp"}),
    "llama-pp2-tp2-sp-1f1b": ("llama", 4, (2, 2), ("PP", "TP"), "1f1b", 4, 1, {"tp": "sp"}),
    "llama-pp2-tp2-sp-interleaved": ("llama", 4, (2, 2), ("PP", "TP"), "interleaved_1f1b", 4, 2, {"tp": "sp"}),
    "gpt-pp2-dp2-accumulate": ("gpt", 4, (2, 2), ("PP", "DP"), "1f1b", 2, 1, {"accumulate": 2}),
    "glue-pp4-accumulate": ("glue", 4, (4,), ("PP",), "1f1b", 2, 1, {"accumulate": 2}),
    "glue-pp4-zb": ("glue", 4, (4,), ("PP",), "zb_h1", 4, 1, {}),
    "glue-pp2-dp2-interleaved": ("glue", 4, (2, 2), ("PP", "DP"), "interleaved_1f1b", 2, 2, {}),
    "llama-pp4-seqlen": ("llama", 4, (4,), ("PP",), "1f1b", 4, 1, {"seqs": (16, 9, 16, 5)}),
    # Hugging Face models built from configs, uneven splits
    "hf_qwen3-pp2-tp2-uneven": ("hf_qwen3", 5, (2, 2), ("PP", "TP"), "1f1b", 4, 1, {"tp": "tp"}),
    "hf_qwen3-pp2-tp2-interleaved": ("hf_qwen3", 6, (2, 2), ("PP", "TP"), "interleaved_1f1b", 4, 2,
                                     {"tp": "tp", "split": ["model.layers.1", "model.layers.3", "model.layers.4"]}),
    "hf_gpt2-pp4-uneven": ("hf_gpt2", 5, (4,), ("PP",), "1f1b", 4, 1, {}),
    "hf_llama-pp2-dp2-params": ("hf_llama", 5, (2, 2), ("PP", "DP"), "1f1b", 2, 1, {"split": "parameters"}),
    "gpt-pp2-dp2-zbv": ("gpt", 4, (2, 2), ("PP", "DP"), "zbv", 4, 2, {}),
    "hf_qwen3-pp2-tp2-zbv": ("hf_qwen3", 6, (2, 2), ("PP", "TP"), "zbv", 4, 2, {"tp": "tp"}),
    "hf_qwen2-pp4-zb": ("hf_qwen2", 4, (4,), ("PP",), "zb_h1", 4, 1, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_single_device(pool4, name):
    kind, layers, shape, names, schedule, m, v, extra = CASES[name]
    for failures in pool4.run(_case, kind, layers, shape, names, schedule, m, v, **extra):
        assert failures == []


# ---- split methods ---------------------------------------------------------------------------

def _case_split_methods():
    """'flops' and 'time' measure a 6-layer GPT (no stage ever materialises the rest) and
    cut where the costs balance; every rank cuts alike; training still matches."""
    m = _mesh((4,), ("PP",))
    x, y = _batches(1)[0]
    out = {}
    for method in ("parameters", "flops", "time"):
        model = _build("gpt", 6)
        pipe = PipelineParallel(model, m, split=method, schedule="1f1b", microbatches=4,
                                sample=((x[:2], y[:2]), {}))
        ranges = pipe.ranges
        everyone = [None] * 4
        torch.distributed.all_gather_object(everyone, ranges)
        assert all(r == ranges for r in everyone), f"{method}: ranks cut differently: {everyone}"
        assert all(b > a for a, b in ranges) and ranges[0][0] == 0 and ranges[-1][1] == 6
        loss = pipe.step(x, y)
        ref = _build("gpt", 6)
        expected = ref(x, y)
        assert mismatch(loss.float(), expected.detach(), rtol=1e-5, atol=1e-6) is None, (method, loss, expected)
        out[method] = ranges
    # the first and last stages carry the embedding / head: they get fewer blocks than uniform
    assert out["parameters"][0][1] - out["parameters"][0][0] <= 2
    return out


def test_split_methods(pool4):
    results = pool4.run(_case_split_methods)
    assert all(r == results[0] for r in results)


# ---- schedules -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                    ("zb_h1", 1), ("zbv", 2)])
def test_schedule_orders_run_and_match_the_analytic_bubble(name, v):
    for p in (2, 3, 4):
        for m in range(1, 13):
            if name == "interleaved_1f1b" and m % p:
                with pytest.raises(ValueError, match="multiple"):
                    make_schedule(name, p, m, v)
                continue
            sched = make_schedule(name, p, m, v)  # simulate() inside: every order finishes
            bubble = simulate(sched)["bubble"]
            if name == "zbv":  # a greedy order, no closed form: below ZB-H1's whenever m >= p
                if m >= p:
                    assert bubble < simulate(make_schedule("zb_h1", p, m))["bubble"], (p, m)
            elif m >= p:
                assert bubble == pytest.approx(analytic_bubble(name, p, m, v), abs=1e-9), (name, p, m)
    if name == "zb_h1":  # zero bubble: about a third of 1F1B's
        assert simulate(make_schedule("zb_h1", 4, 8))["bubble"] <= simulate(make_schedule("1f1b", 4, 8))["bubble"] / 2


def test_schedule_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("2f2b", 2, 4)
    with pytest.raises(ValueError, match="virtual_stages"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="at least 1"):
        make_schedule("1f1b", 2, 0)


# ---- bad splits: clear errors, the same on every rank, nobody left waiting --------------------

class _SkipToHead(nn.Module):
    """The embedding's output is used again after the blocks: it would have to cross every cut."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 64)

    def forward(self, x, y):
        e = self.emb(x)
        h = e
        for b in self.blocks:
            h = torch.tanh(b(h))
        return F.cross_entropy(self.head(h + e).flatten(0, 1), y.flatten())


class _SideInput(nn.Module):
    """Every block also takes the embedding's output: it crosses the cut into the first
    block (which is fine) but later blocks take it from outside the boundary."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Linear(32, 16) for _ in range(4)])
        self.head = nn.Linear(16, 64)

    def forward(self, x, y):
        e = self.emb(x)
        h = e
        for b in self.blocks:
            h = torch.tanh(b(torch.cat([h, e], -1)))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _case_errors():
    m = _mesh((4,), ("PP",))
    x, y = _batches(1)[0]
    seen = {}

    def expect(key, fn, error=PipelineSplitError):
        try:
            fn()
        except error as e:
            seen[key] = str(e)
            return
        raise AssertionError(f"{key}: no {error.__name__}")

    expect("unknown block", lambda: PipelineParallel(_build("gpt", 4), m, split=["h.1", "h.2", "h.3"]))
    expect("empty stage", lambda: PipelineParallel(_build("gpt", 4), m,
                                                   split=["transformer.h.1", "transformer.h.1", "transformer.h.3"]))
    expect("too many stages", lambda: PipelineParallel(_build("gpt", 3), m))
    expect("wrong count", lambda: PipelineParallel(_build("gpt", 4), m, split=["transformer.h.2"]))
    expect("unknown method", lambda: PipelineParallel(_build("gpt", 4), m, split="even"))
    expect("no sample", lambda: PipelineParallel(_build("gpt", 4), m, split="flops"))
    expect("no blocks", lambda: PipelineParallel(nn.Linear(4, 4), m))
    torch.manual_seed(0)
    expect("skip to head", lambda: PipelineParallel(_SkipToHead(), m).step(x, y))
    torch.manual_seed(0)
    expect("side input", lambda: PipelineParallel(_SideInput(), m).step(x, y))
    pipe = PipelineParallel(_build("gpt", 4), m, microbatches=2)
    expect("call", lambda: pipe(x, y), RuntimeError)
    expect("model call", lambda: pipe.module(x, y), RuntimeError)
    expect("small batch", lambda: pipe.step(x[:1], y[:1]), ValueError)
    # after all that, the ranks still work together
    loss = pipe.step(x, y)
    assert torch.isfinite(loss)
    return seen


def test_bad_splits_raise_clear_errors(pool4):
    results = pool4.run(_case_errors)
    for r in results:  # alike on every rank (bar calling the model, which names a module the rank lacks)
        assert {k: v for k, v in r.items() if k != "model call"} == \
            {k: v for k, v in results[0].items() if k != "model call"}
    seen = results[0]
    print("\n".join(f"{k}: {v}" for k, v in seen.items()))
    assert "transformer.h.2" in seen["unknown block"]  # names a real block as the example
    assert "no blocks" in seen["empty stage"]
    assert "at most 3 stages" in seen["too many stages"]
    assert "need 3 split points" in seen["wrong count"]
    assert "uniform" in seen["unknown method"]
    assert "sample=" in seen["no sample"]
    assert "nn.ModuleList" in seen["no blocks"]
    assert "'emb'" in seen["skip to head"] and "split point 'blocks.3'" in seen["skip to head"]
    assert "'emb'" in seen["side input"] and "blocks.1" in seen["side input"]
    assert "step(" in seen["call"] and "step" in seen["model call"]


def test_simulator_takes_stage_costs_and_sends():
    """The schedules' clock (C++, autoplan/pipeline_sim) with costs per stage and link
    times: one micro-batch through two ranks waits for each crossing once each way."""
    sched = make_schedule("gpipe", 2, 1)
    free = simulate(sched, stage_costs=[(1, 2, 1, 1), (1, 2, 1, 1)])
    assert free["makespan"] == 6 and free == simulate(sched)
    slow = simulate(sched, stage_costs=[(1, 2, 1, 1), (1, 2, 1, 1)], send_forward=[0.5], send_backward=[0.25])
    assert slow["makespan"] == 6.75 and slow["busy"] == [3.0, 3.0]
    timeline = {(k, s, mb): (start, end) for k, s, mb, _, start, end in slow["actions"]}
    assert timeline[("F", 1, 0)] == (1.5, 2.5) and timeline[("B", 0, 0)] == (4.75, 6.75)
    doubled = simulate(make_schedule("1f1b", 4, 8), stage_costs=[(2, 4, 2, 2)] * 4)
    assert doubled["makespan"] == 2 * simulate(make_schedule("1f1b", 4, 8))["makespan"]
