"""vescale.deferred_init: models built on the meta device and materialised shard by shard
hold, bitwise, the values of the same constructor run on one device with the same seed
(on 1-d and 2-d meshes, uneven shards included); the generator ends where the ordinary
constructor leaves it; peak memory stays near the local shard; a constructor that reads
values gets a clear error."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import vescale
from vescale import Replicate, Shard
from vescale.deferred import DeferredInitError, deferred_init, materialize_module
from vescale.parallel import parallelize_module
from vescale.parallel.plans import gpt_plan, llama_plan

from dist_utils import mesh
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM


class Zoo(nn.Module):
    """The ways constructors initialise: module defaults, an _init_weights loop, the
    torch.nn.init family, a seed set inside, copies from computed tensors, buffers,
    padding rows, and tensors big enough to be streamed in several chunks (odd sizes,
    so normal_'s last-16 redraw and a short last chunk both happen)."""

    def __init__(self, big: int = (1 << 20) + 5):
        super().__init__()
        self.emb = nn.Embedding(37, 12, padding_idx=3)
        self.lin = nn.Linear(12, 30)
        self.blocks = nn.ModuleList(nn.Linear(30, 30, bias=False) for _ in range(2))
        self.norm = nn.LayerNorm(30)
        torch.manual_seed(1234)  # some models reseed mid-construction
        self.trunc = nn.Parameter(torch.empty(29, 31))
        nn.init.trunc_normal_(self.trunc, std=0.02, a=-0.03, b=0.03)
        self.kaiming = nn.Parameter(torch.empty(18, 10))
        nn.init.kaiming_normal_(self.kaiming, nonlinearity="relu")
        self.xavier = nn.Parameter(torch.empty(10, 22))
        nn.init.xavier_uniform_(self.xavier)
        self.big = nn.Parameter(torch.randn(big) * 0.5)
        self.big2 = nn.Parameter(torch.empty(1031, 1029).uniform_(-1, 1))
        self.ortho = nn.Parameter(torch.empty(8, 6))
        nn.init.orthogonal_(self.ortho)
        self.pos = nn.Parameter(torch.empty(16, 12))
        with torch.no_grad():
            self.pos.copy_(torch.arange(16 * 12, dtype=torch.float32).view(16, 12).sin() * 0.1)
        self.register_buffer("freqs", 1.0 / (10000 ** (torch.arange(0, 12, 2).float() / 12)))
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def _same(a: nn.Module, b: nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    return [n for n in sa if not torch.equal(sa[n], sb[n])]


def test_whole_materialisation_is_bitwise_single_device():
    torch.manual_seed(0)
    ref, ref_next = Zoo(), torch.rand(4)
    torch.manual_seed(0)
    model = deferred_init(Zoo)
    next_draw = torch.rand(4)
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(next_draw, ref_next)  # the generator moved on exactly as in a real construction
    materialize_module(model)
    assert _same(model, ref) == []
    assert not any(t.is_meta for t in model.state_dict().values())


def _hugging_face(name: str):
    import transformers as tf
    tokens = dict(bos_token_id=0, eos_token_id=1, pad_token_id=0)
    configs = {
        "gpt2": lambda: (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=48, n_positions=64, n_embd=32, n_layer=2,
                                                           n_head=4, **tokens)),
        "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=2, num_attention_heads=4,
                                                              num_key_value_heads=2, **tokens)),
        "bert": lambda: (tf.BertForMaskedLM, tf.BertConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=64,
                                                           pad_token_id=0)),
        "t5": lambda: (tf.T5ForConditionalGeneration, tf.T5Config(vocab_size=48, d_model=32, d_kv=8, d_ff=64,
                                                                  num_layers=2, num_heads=4, **tokens)),
    }
    return configs[name]()


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_hugging_face_models_get_their_own_initialisation(name):
    """transformers skips a model's _init_weights on the meta device (it expects a
    checkpoint); deferred_init still gives the values of an ordinary build (the set-up
    fuzzer found GPT-2's embeddings drawn with std 1 instead of 0.02)."""
    cls, config = _hugging_face(name)
    torch.manual_seed(0)
    ref, ref_next = cls(config), torch.rand(4)
    torch.manual_seed(0)
    model = deferred_init(cls, config)
    next_draw = torch.rand(4)
    materialize_module(model)
    assert _same(model, ref) == []
    assert torch.equal(next_draw, ref_next)
    tied = [n for n, p in ref.named_parameters(remove_duplicate=False)] != [n for n, p in ref.named_parameters()]
    assert tied == ([n for n, p in model.named_parameters(remove_duplicate=False)]
                    != [n for n, p in model.named_parameters()])  # ties as in the ordinary build


def test_a_deferred_model_cast_to_low_precision_stays_deferred():
    """``mixed_precision.param_dtype`` casts the model before it is sharded; a plain
    ``.to`` of a deferred model left meta tensors with no recording, and sharding them
    raised (the set-up fuzzer). cast_deferred keeps them deferred, and their values are
    the ordinary build's, cast."""
    from vescale.deferred import cast_deferred, is_deferred

    cfg = GPTConfig(vocab_size=37, n_embd=24, n_head=2, n_layer=2)
    torch.manual_seed(0)
    ref = GPT(cfg).to(torch.bfloat16)
    torch.manual_seed(0)
    model = deferred_init(GPT, cfg)
    params = list(model.parameters())
    cast_deferred(model, torch.bfloat16)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # identity kept
    assert all(is_deferred(p) and p.dtype == torch.bfloat16 for p in model.parameters())
    materialize_module(model)
    assert _same(model, ref) == []


def test_reading_values_in_the_constructor_is_a_clear_error():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            if self.w.sum() > 0:  # data-dependent control flow
                self.w.data.mul_(2)

    with pytest.raises(DeferredInitError, match="reads tensor values.*src_data_rank=0"):
        deferred_init(Reads)


def test_plain_meta_tensor_is_refused_by_distribute_tensor():
    with pytest.raises(ValueError, match="deferred_init"):
        vescale.distribute_tensor(torch.empty(4, device="meta"), None, None)


# ---- sharded ----------------------------------------------------------------------------------

def _case_sharded(model_name: str, mesh_name: str) -> list[str]:
    m = mesh(mesh_name)
    tp = m["TP"] if mesh_name == "2d" else m
    cls, cfg, plan = {"gpt": (GPT, GPTConfig(vocab_size=66, n_embd=36, n_head=6), gpt_plan),
                      "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=66), llama_plan)}[model_name]
    torch.manual_seed(0)
    ref = cls(cfg)
    torch.manual_seed(0)
    model = deferred_init(cls, cfg)
    parallelize_module(model, tp, plan())
    failures = [n for n, p in model.named_parameters() if p.is_meta]
    for (name, p), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        full = p.full_tensor() if isinstance(p, vescale.DTensor) else p
        if not torch.equal(full, r):
            failures.append(name)
    return failures


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
@pytest.mark.parametrize("mesh_name", ["1d4", "2d"])
def test_parallelized_shards_are_bitwise_single_device(pool4, model_name, mesh_name):
    assert pool4.run(_case_sharded, model_name, mesh_name) == [[]] * 4


def _case_zoo_placements() -> list[str]:
    m = mesh("2d")
    torch.manual_seed(0)
    ref = Zoo()
    torch.manual_seed(0)
    model = deferred_init(Zoo)
    failures = []
    # uneven everywhere: 1031 rows over 2x2, 29 rows over 2, the streamed 1-d tensor over 4
    for name, placements in [("big2", [Shard(0), Shard(0)]), ("trunc", [Replicate(), Shard(0)]),
                             ("big", [Shard(0), Shard(0)]), ("pos", [Shard(1), Replicate()]),
                             ("ortho", [Shard(0), Shard(1)]), ("emb.weight", [Shard(0), Replicate()])]:
        dt = vescale.distribute_tensor(model.get_parameter(name).detach(), m, placements)
        if not torch.equal(dt.full_tensor(), ref.get_parameter(name).detach()):
            failures.append(name)
    return failures


def test_placements_with_uneven_shards(pool4):
    assert pool4.run(_case_zoo_placements) == [[]] * 4


# ---- memory -----------------------------------------------------------------------------------

class Wide(nn.Module):
    def __init__(self, layers: int, side: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(layers))


def _peak_rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _case_memory(layers: int, side: int) -> dict:
    import ctypes
    import gc

    m = mesh("1d4")
    deferred_init(Wide, 1, 8)  # the first dispatch mode loads ~70 MB of library code: not model memory
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    base = _peak_rss_kb()
    model = deferred_init(Wide, layers, side)
    plan = {"parameter": {r"layers\.\d+\.weight": [Shard(0)]}}
    parallelize_module(model, m, plan)
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    return dict(peak_kb=_peak_rss_kb() - base, local_kb=local // 1024)


def test_peak_memory_is_the_local_shard_plus_a_constant(pool4):
    """A 256 MiB fp32 model on TP4: each rank may hold its 64 MiB shard plus a constant
    of 16 MiB (the 4 MiB chunk buffer, allocator slack, Python objects), so the model is
    3.2x a rank's budget (4x would leave no room for any constant: the shard alone is a
    quarter). Peak resident memory (VmHWM) is measured from just before deferred_init,
    after a first tiny deferred_init has loaded the library code dispatch modes pull in."""
    layers, side = 4, 4096  # 4 x 64 MiB: materialising any one tensor whole would break the budget
    constant_kb = 16 * 1024
    full_kb = layers * side * side * 4 // 1024
    for r in pool4.run(_case_memory, layers, side):
        assert r["local_kb"] * 4 == full_kb
        assert full_kb >= 3 * (r["local_kb"] + constant_kb)
        assert r["peak_kb"] < r["local_kb"] + constant_kb, r


# ---- from a checkpoint ------------------------------------------------------------------------

def _case_from_checkpoint(path: str) -> list[str]:
    import vescale.deferred as di

    m = mesh("2d")
    torch.manual_seed(5)
    trained = GPT(GPTConfig(vocab_size=66, n_embd=36, n_head=6))
    if torch.distributed.get_rank() == 0:
        torch.save(trained.state_dict(), path + ".ref.pt")
    parallelize_module(trained, m["TP"], gpt_plan())
    vescale.save(path, {"model": trained})
    model = deferred_init(GPT, GPTConfig(vocab_size=66, n_embd=36, n_head=6))
    streamed = []
    real_stream = di.stream
    di.stream = lambda *a, **k: streamed.append(1) or real_stream(*a, **k)  # counts random inits
    try:
        vescale.load(path, {"model": model})
        parallelize_module(model, m, {"parameter": {r".*c_attn\.weight": [Shard(0), Shard(1)]}})
        materialize_module(model)
    finally:
        di.stream = real_stream
    ref = torch.load(path + ".ref.pt")
    failures = ["random init ran"] if streamed else []
    for name, p in model.state_dict().items():
        full = p.full_tensor() if isinstance(p, vescale.DTensor) else p
        if not torch.equal(full, ref[name]):
            failures.append(name)
    return failures


def test_checkpoint_fills_a_deferred_model_without_running_its_init(pool4, tmp_path):
    assert pool4.run(_case_from_checkpoint, str(tmp_path / "ckpt")) == [[]] * 4


def _case_saved_before_its_first_step(path: str, mesh_shape: dict) -> list[str]:
    """A deferred model set up by vescale.parallelize and saved, or exported, before it
    ran (a seed checkpoint): every rank raised "Cannot copy out of meta tensor" (save), or
    one pipeline stage's ranks did while the others waited (export_torch). Saving
    materialises it as its first forward would; the values are one device's, bitwise, and
    the model trains on from there."""
    cfg = GPTConfig(dropout=0.0, bias=False, n_layer=2)
    torch.manual_seed(3)
    model = deferred_init(GPT, cfg)
    plan = vescale.Plan({"mesh": mesh_shape, "pipeline_parallel.microbatches": 2})
    model, optimizer, _, _ = vescale.parallelize(plan, model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    vescale.save(path, {"model": model})
    vescale.checkpoint.export_torch(path + ".pt", model)
    torch.manual_seed(3)
    ref = GPT(cfg)
    failures = []
    if torch.distributed.get_rank() == 0:
        exported = torch.load(path + ".pt")
        want = ref.state_dict()  # (tied parameters are exported under their first name)
        failures += [n for n, t in exported.items() if not torch.equal(t, want[n])] or ([] if exported else ["empty"])
    x = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    rows = x.tensor_split(mesh_shape.get("DP", 1))[torch.distributed.get_rank() % mesh_shape.get("DP", 1)]
    loss = model(rows, rows)
    loss.backward()
    optimizer.step()
    want = ref(x, x)
    if abs(loss.item() - want.item()) > 1e-5 * abs(want.item()):
        failures.append(f"loss {loss.item()} vs one device's {want.item()}")
    return failures


@pytest.mark.parametrize("mesh_shape", [{"DP": 4}, {"PP": 2, "DP": 2}], ids=["dp4", "pp2-dp2"])
def test_a_deferred_model_saved_before_its_first_step(pool4, tmp_path, mesh_shape):
    assert pool4.run(_case_saved_before_its_first_step, str(tmp_path / "seed"), mesh_shape) == [[]] * 4


# ---- DDP and ZeRO -----------------------------------------------------------------------------

def _case_zero(stage: int) -> list[str]:
    """DDP leaves a deferred model alone (no broadcast: every rank materialises the same
    values); ZeRO-1/2 materialise it whole, ZeRO-3 only each rank's slices."""
    from vescale.parallel import DDP, DistributedOptimizer

    torch.manual_seed(0)
    ref = Zoo(big=4099)
    torch.manual_seed(0)
    model = DDP(deferred_init(Zoo, big=4099), mesh("1d4"))
    if not stage:
        materialize_module(model.module)  # what DDP's first forward does
        return _same(model.module, ref)
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=stage, lr=1e-3)
    with opt.full_parameters():
        return _same(model.module, ref)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_ddp_and_zero_materialise_deferred_models(pool4, stage):
    assert pool4.run(_case_zero, stage) == [[]] * 4


def _case_seeded_apart(stage: int, tp: bool) -> list[str]:
    """Ranks seeded apart (a per-rank seed for dropout or augmentation) before building:
    what a built model gets from DDP's or distribute_tensor's broadcast from rank 0."""
    import torch.distributed as dist
    from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
    from vescale.parallel.plans import gpt_plan

    cfg = GPTConfig(vocab_size=32, n_embd=16, n_head=2, n_layer=2, dropout=0.0)
    torch.manual_seed(100)
    ref = GPT(cfg)
    torch.manual_seed(100 + dist.get_rank())
    model = deferred_init(GPT, cfg)
    if tp:
        parallelize_module(model, mesh("2d")["TP"], gpt_plan())
    model = DDP(model, mesh("2d")["DP"] if tp else mesh("1d4"))
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=stage, lr=0.1) if stage else None
    if not stage:
        materialize_module(model.module)  # what DDP's first forward does
    with opt.full_parameters() if stage else contextlib.nullcontext():
        return _same(model.module, ref)


@pytest.mark.parametrize("stage, tp", [(0, False), (3, False), (0, True), (1, True)])
def test_ranks_seeded_apart_build_rank_0s_model(pool4, stage, tp):
    assert pool4.run(_case_seeded_apart, stage, tp) == [[]] * 4


def _case_ddp_trains(stage: int) -> list[str]:
    """A deferred model trained under DDP / ZeRO takes the step of the whole batch. DDP
    materialises at the first forward, after registering its gradient hooks: swapping
    the values in dropped those hooks (torch.utils.swap_tensors leaves them behind), so
    no gradient was averaged and every rank stepped with its own (the set-up fuzzer)."""
    import torch.distributed as dist

    from dist_utils import mismatch_to_max
    from vescale.parallel import DDP, DistributedOptimizer

    cfg = GPTConfig(vocab_size=32, n_embd=16, n_head=2, n_layer=2, dropout=0.0)
    data = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(5))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.optim.SGD(ref.parameters(), lr=0.5).zero_grad()
    ref(x, y).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    torch.manual_seed(0)
    model = DDP(deferred_init(GPT, cfg), mesh("1d4"))
    opt = (torch.optim.SGD(model.parameters(), lr=0.5) if not stage
           else DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=stage, lr=0.5))
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    model(x[mine], y[mine]).backward()
    opt.step()
    with opt.full_parameters() if stage else contextlib.nullcontext():
        got = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return [f"{n}: {err}" for n, p in ref.named_parameters() if (err := mismatch_to_max(got[n], p.detach()))]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ddp_and_zero_train_deferred_models(pool4, stage):
    assert pool4.run(_case_ddp_trains, stage) == [[]] * 4


def test_recording_is_dropped_with_its_module():
    import gc

    import vescale.deferred as di

    before = len(di._histories)
    model = deferred_init(Zoo, big=64)
    assert len(di._histories) > before
    del model
    gc.collect()
    assert len(di._histories) == before
