"""vescale on a CUDA device: a 1-rank NCCL mesh against plain torch on the same GPU.

The rest of the suite runs on gloo ranks on the CPU; these cases are the CUDA paths:
NCCL process groups, local shards on the GPU, the CUDA attention kernels (flash,
memory-efficient, cuDNN) through the attention rule, autocast, the CUDA generator,
deferred_init and checkpoints onto a GPU, a Hugging Face model's ``generate``. A mesh
of one rank issues no collective, so every difference from plain torch would be the
engine's own (layouts, kernels chosen, dtypes, devices). Tolerances: the same kernels
run on the same shapes, so results agree to rounding (rtol 1e-5; gradients within 1e-5
of each tensor's largest element). Random draws of a rank's block
(sharding_rules/random_local_cuda.h) are compared bit for bit with torch's whole draws,
directly and on two gloo ranks sharing the GPU.

They need a GPU and are skipped without one (CI's machines have none). On a GPU
machine: ``python -m pytest tests/python/test_cuda.py``; results are recorded in
docs/benchmarks.md ("On a GPU").
"""

from __future__ import annotations

import itertools
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vescale
from vescale import InterleavedShard, Partial, Replicate, Shard, _C
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.plans import gpt_plan, hf_plan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from examples.models.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")

CONFIG = GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_embd=64)


@pytest.fixture(scope="module")
def mesh():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    m = vescale.init_device_mesh("cuda", (1, 1), mesh_dim_names=("DP", "TP"))
    assert dist.get_backend() == "nccl"
    yield m
    dist.destroy_process_group()


def close(a, b, rtol=1e-5):
    a, b = (t.full_tensor() if isinstance(t, vescale.DTensor) else t for t in (a, b))
    assert a.device.type == "cuda" and a.dtype == b.dtype, (a.device, a.dtype, b.dtype)
    scale = b.abs().max().item() if b.numel() else 0.0
    assert (a.double() - b.double()).abs().max().item() <= rtol * max(scale, 1e-30), \
        f"max error {(a.double() - b.double()).abs().max().item():.3g}, largest element {scale:.3g}"


def test_a_chain_of_ops_matches_plain(mesh):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 16, 32, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(64, 32, device="cuda", generator=g, requires_grad=True)
    ids = torch.randint(0, 64, (8, 16), device="cuda", generator=g)

    def chain(x, w):
        h = F.gelu(x @ w.t())
        h = F.layer_norm(h, (64,)).softmax(-1) * 3 + h.cumsum(1)
        return F.cross_entropy(h.flatten(0, 1), ids.flatten()) + h.pow(2).mean(0).sum()

    ref = chain(x, w)
    ref.backward()
    dx = vescale.distribute_tensor(x.detach(), mesh, [Shard(0), Replicate()]).requires_grad_()
    dw = vescale.distribute_tensor(w.detach(), mesh, [Replicate(), Shard(0)]).requires_grad_()
    out = chain(dx, dw)
    out.backward()
    close(out, ref)
    close(dx.grad, x.grad)
    close(dw.grad, w.grad)


def test_redistribution_and_partial_on_cuda(mesh):
    t = torch.randn(6, 10, device="cuda")
    d = vescale.distribute_tensor(t, mesh, [Shard(1), Shard(0)])
    assert d.to_local().device.type == "cuda"
    for placements in ([Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(1)]):
        close(d.redistribute(placements=placements), t)
    p = vescale.DTensor.from_local(t.clone(), mesh, [Partial(), Replicate()])
    close(p.redistribute(placements=[Replicate(), Replicate()]), t)
    close(d.redistribute(placements=[Replicate(), Replicate()], async_op=True) * 2, t * 2)


def test_a_cpu_tensor_is_moved_to_the_meshs_gpu(mesh):
    t = torch.randn(4, 4)
    d = vescale.distribute_tensor(t, mesh, [Replicate(), Shard(0)])
    assert d.to_local().device.type == "cuda"
    close(d, t.cuda())


@pytest.mark.parametrize("backend,dtype", [("FLASH_ATTENTION", torch.bfloat16), ("EFFICIENT_ATTENTION", torch.float32),
                                           ("CUDNN_ATTENTION", torch.bfloat16), ("MATH", torch.float32)])
def test_attention_kernels(mesh, backend, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 4, 32, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
               for _ in range(3))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref.float().square().sum().backward()
        dq, dk, dv = (vescale.distribute_tensor(t.detach(), mesh, [Replicate(), Shard(1)]).requires_grad_()
                      for t in (q, k, v))
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        out.float().square().sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    close(out, ref, tol)
    for mine, theirs in ((dq, q), (dk, k), (dv, v)):
        close(mine.grad, theirs.grad, tol)
    assert not any("attention" in op for op in vescale.fallback_counts())  # the attention rule ran it


def _gpt_on_cuda() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).cuda()


def _batches(n=3):
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, CONFIG.vocab_size, (4, 33), generator=g).cuda() for _ in range(n)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _train(model, opt, batches):
    losses, first_grads = [], None
    for idx, tgt in batches:
        loss = model(idx, tgt)
        loss.backward()
        if first_grads is None:
            first_grads = {n: None if p.grad is None else
                           (p.grad.full_tensor() if isinstance(p.grad, vescale.DTensor) else p.grad).clone()
                           for n, p in _named_parameters(model)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss).item())
    return losses, first_grads


def _named_parameters(model):
    inner = getattr(model, "module", model)
    return [(n.removeprefix("module."), p) for n, p in inner.named_parameters()]


@pytest.mark.parametrize("layout", ["tp", "tp-sp", "ddp", "dp-tp-zero2", "dp-tp-sp-zero3"])
def test_gpt_training_matches_plain(mesh, layout):
    batches = _batches()
    ref_model = _gpt_on_cuda()
    ref = _train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), batches)

    model = _gpt_on_cuda()
    if "tp" in layout:
        parallelize_module(model, mesh["TP"], gpt_plan(sequence_parallel="sp" in layout))
    if layout.startswith("d"):
        model = DDP(model, mesh["DP"])
    zero = int(layout[-1]) if "zero" in layout else 0
    opt = (DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=zero, lr=1e-2) if zero
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, grads = _train(model, opt, batches)
    torch.testing.assert_close(losses, ref[0], rtol=1e-5, atol=0)
    if not zero:  # ZeRO-2/3 keep gradient slices in their buckets: the losses check them
        for name, g in ref[1].items():
            close(grads[name], g)
    assert all(p.device.type == "cuda" for _, p in _named_parameters(model))


def test_parallelize_with_a_plan(mesh):
    """The RFC loop on a GPU: vescale.parallelize with a plan (TP + SP, ZeRO-2, clipping)."""
    batches = _batches()
    ref_model = _gpt_on_cuda()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref = []
    for idx, tgt in batches:
        loss = ref_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        ref.append(loss.item())
    plan = vescale.Plan({"mesh": {"DP": 1, "TP": 1}, "tensor_parallel.sharding_plan": gpt_plan(sequence_parallel=True),
                         "tensor_parallel.sequence_parallel": True, "data_parallel.zero_stage": 2,
                         "gradient.clip_norm": 0.5})
    model, opt, _, _ = vescale.parallelize(plan, _gpt_on_cuda(), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    losses = []
    for idx, tgt in batches:
        opt.zero_grad()
        loss = model((idx, tgt))
        loss.backward()
        opt.step()
        losses.append((loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss).item())
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=0)


def test_bf16_autocast_matches_plain(mesh):
    idx, tgt = _batches(1)[0]
    ref_model = _gpt_on_cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_logits = ref_model(idx)
        ref = F.cross_entropy(ref_logits.float().flatten(0, 1), tgt.flatten())
    ref.backward()
    model = _gpt_on_cuda()
    parallelize_module(model, mesh["TP"], gpt_plan())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    loss.backward()
    assert logits.dtype == ref_logits.dtype == torch.bfloat16
    close(logits, ref_logits, 1e-2)
    close(loss, ref, 1e-3)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32, name
        close(p.grad, q.grad, 2e-2)


def test_dropout_draws_what_one_device_draws(mesh):
    x = torch.ones(64, 128, device="cuda")
    d = vescale.distribute_tensor(x, mesh, [Replicate(), Shard(0)])
    torch.cuda.manual_seed(11)
    ref = F.dropout(x, 0.3)
    torch.cuda.manual_seed(11)
    out = F.dropout(d, 0.3)
    close(out, ref, 0)
    torch.cuda.manual_seed(12)
    ref = torch.empty(1000, device="cuda").normal_()
    torch.cuda.manual_seed(12)
    out = vescale.distribute_tensor(torch.empty(1000, device="cuda"), mesh, [Replicate(), Shard(0)]).normal_()
    close(out, ref, 0)


def test_deferred_init_materialises_on_the_gpu(mesh):
    torch.manual_seed(0)
    ref = GPT(CONFIG)
    torch.manual_seed(0)
    model = vescale.deferred_init(GPT, CONFIG)
    parallelize_module(model, mesh["TP"], gpt_plan())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.to_local().device.type == "cuda", name
        close(p, q.cuda(), 0)


def test_checkpoint_round_trip_from_the_gpu(mesh, tmp_path):
    model = _gpt_on_cuda()
    parallelize_module(model, mesh["TP"], gpt_plan())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, tgt = _batches(1)[0]
    model(idx, tgt).backward()
    opt.step()
    vescale.save(str(tmp_path / "ckpt"), {"model": model, "optimizer": opt})
    torch.manual_seed(1)
    other = GPT(CONFIG).cuda()
    parallelize_module(other, mesh["TP"], gpt_plan())
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    vescale.load(str(tmp_path / "ckpt"), {"model": other, "optimizer": other_opt})
    for (name, p), (_, q) in zip(other.named_parameters(), model.named_parameters()):
        close(p, q, 0)
    plain = GPT(CONFIG)  # into a plain CPU model
    vescale.load(str(tmp_path / "ckpt"), {"model": plain}, strict=False)  # the optimizer's state left out
    for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p, q.full_tensor().cpu(), rtol=0, atol=0)


def test_hugging_face_llama_generates_the_same_tokens(mesh):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).cuda().eval()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    parallelize_module(model, mesh["TP"], hf_plan(model))
    x = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(x)
    with torch.no_grad():
        want = ref.generate(input_ids=x, attention_mask=mask, max_new_tokens=8, do_sample=False)
        got = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = got.full_tensor() if isinstance(got, vescale.DTensor) else got
    assert torch.equal(got, want)


# ---- random draws of a box alone (sharding_rules/random_local_cuda.h) ------------------------

# (op, a, b): the fill's op name and parameters as _C._rng_draw_box takes them
BOX_FILLS = [("uniform_", -1.0, 3.0), ("normal_", 0.5, 2.0), ("log_normal_", 0.1, 0.5), ("exponential_", 1.5, 0.0),
             ("cauchy_", 0.2, 1.1), ("geometric_", 0.3, 0.0), ("bernoulli_.float", 0.3, 0.0)]
# shape -> boxes (offsets, sizes). The big shapes take several rounds of the fill's grid
# (on an H100, 270,336 threads x 4 values); boxes whose runs span a round or more go
# round by round as torch's kernel does, the others element by element: both are here,
# runs starting off a round's edge included.
BOX_SHAPES = {
    (1000,): [((0,), (1000,)), ((250,), (250,)), ((993,), (7,)), ((3,), (1,))],
    (37, 53): [((10, 0), (9, 53)), ((0, 13), (37, 14)), ((36, 40), (1, 13))],
    (3, 2100, 700): [((1, 0, 0), (1, 2100, 700)), ((0, 0, 175), (3, 2100, 175)), ((2, 1500, 0), (1, 600, 700))],
    (3, 4200, 700): [((0, 1000, 0), (3, 2100, 700)), ((1, 0, 0), (2, 4200, 700))],
}


def _fill(op, a, b, t):
    one_parameter = op in ("exponential_", "geometric_", "bernoulli_.float")
    return getattr(t, op.split(".")[0])(*((a,) if one_parameter else (a, b)))


def _box(t, offsets, sizes):
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


# every fill in every floating dtype, and bernoulli_, the one fill of bool tensors
BOX_CASES = [(*fill, dtype) for fill in BOX_FILLS
             for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]
BOX_CASES.append(("bernoulli_.float", 0.3, 0.0, torch.bool))


@pytest.mark.parametrize("op,a,b,dtype", BOX_CASES, ids=[f"{c[0]}-{c[3]}" for c in BOX_CASES])
def test_a_box_draw_is_the_box_of_the_whole_fill_and_moves_the_generator_alike(op, a, b, dtype):
    failures = []
    for shape, boxes in BOX_SHAPES.items():
        torch.cuda.manual_seed(11)
        whole = _fill(op, a, b, torch.empty(shape, dtype=dtype, device="cuda"))
        after = torch.cuda.get_rng_state()
        for offsets, sizes in boxes:
            torch.cuda.manual_seed(11)
            out = torch.empty(sizes, dtype=dtype, device="cuda")
            assert _C._rng_draw_box(op, a, b, list(shape), list(offsets), list(sizes), out)
            want = _box(whole, offsets, sizes)
            if not torch.equal(out, want):
                failures.append(f"{shape} {offsets} {sizes}: {int((out != want).sum())} of {want.numel()} differ")
            if not torch.equal(torch.cuda.get_rng_state(), after):
                failures.append(f"{shape} {offsets} {sizes}: generator state")
    assert failures == []


# numel divisible by 8; by 4 only; by 2 only; odd: each vector width of torch's dropout
# kernel (16 bytes, halved until it divides numel), and a shape of several rounds
DROPOUT_SHAPES = {
    (64, 1000): [((0, 0), (32, 1000)), ((32, 0), (32, 1000)), ((0, 250), (64, 250)), ((5, 3), (50, 250))],
    (3, 2, 1002): [((1, 0, 0), (1, 2, 1002)), ((0, 1, 500), (3, 1, 502)), ((0, 0, 3), (3, 2, 997))],
    (2, 3, 1001): [((0, 0, 0), (1, 3, 1001)), ((0, 2, 0), (2, 1, 1001))],
    (37, 53): [((10, 0), (9, 53)), ((0, 13), (37, 14))],
    (4, 2100, 700): [((0, 525, 0), (4, 525, 700)), ((3, 0, 0), (1, 2100, 700))],
    (2, 8000, 700): [((0, 1000, 0), (2, 4000, 700))],    # runs of 2.8M: a round even at width 8
    (3, 4201, 701): [((0, 1000, 0), (3, 2100, 701))],    # odd: width 1, runs of 1.5M
    (3, 4201, 702): [((0, 1000, 0), (3, 2100, 702))],    # even, not by 4: width 2
}


def _unaligned_copy(t):
    """t's values in a contiguous tensor one element past an allocation's start: 16-byte
    vector loads cannot be used on it."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned_input"])
def test_a_dropout_box_is_the_box_of_the_whole_dropout(dtype, p, aligned):
    failures = []
    for shape, boxes in DROPOUT_SHAPES.items():
        torch.manual_seed(2)
        x = torch.randn(shape, device="cuda").to(dtype)  # fresh, as an activation is
        torch.cuda.manual_seed(7)
        want_out, want_mask = torch.ops.aten.native_dropout(x, p, True)
        after = torch.cuda.get_rng_state()
        for offsets, sizes in boxes:
            torch.cuda.manual_seed(7)
            block = _box(x, offsets, sizes).contiguous()
            got = _C._rng_dropout_box(block if aligned else _unaligned_copy(block), p, list(shape), list(offsets),
                                      list(sizes))
            assert got is not None
            for what, g, w in zip(("output", "mask"), got, (_box(want_out, offsets, sizes), _box(want_mask, offsets, sizes))):
                if not torch.equal(g, w):
                    failures.append(f"{shape} {offsets} {sizes}: {what}, {int((g != w).sum())} of {w.numel()} differ")
            if not torch.equal(torch.cuda.get_rng_state(), after):
                failures.append(f"{shape} {offsets} {sizes}: generator state")
    assert failures == []


# Two ranks on the one GPU (gloo between them: random ops communicate nothing): every
# rank's block of a sharded draw is its block of the one-device draw, and both leave the
# generator where the one-device draw does. (`device` "cpu" runs the same on the CPU.)
def _random_ops_on_two_ranks(rank: int, world: int, port: int, device: str = "cuda") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    seed = torch.cuda.manual_seed if cuda else torch.manual_seed
    rng_state = torch.cuda.get_rng_state if cuda else torch.get_rng_state
    m = vescale.init_device_mesh(device, (world,), mesh_dim_names=("TP",))
    ops = {
        "normal_": lambda t: t.normal_(0.5, 2.0),
        "uniform_": lambda t: t.uniform_(-1.0, 1.0),
        "bernoulli_": lambda t: t.bernoulli_(0.3),
        "exponential_": lambda t: t.exponential_(2.0),
        "dropout": lambda t: F.dropout(t, 0.1, training=True),
        "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    }
    layouts = [[Shard(0)], [Shard(1)], [Replicate()], [InterleavedShard(1, 2)]]
    failures = []
    for dtype, shape in [(torch.float32, (13, 32)), (torch.bfloat16, (13, 32)), (torch.float32, (520, 2100))]:
        for (name, fn), placements in itertools.product(ops.items(), layouts):
            torch.manual_seed(3)
            x = torch.randn(shape).to(dtype).to(device)
            seed(9)
            want = fn(x.clone())
            after = rng_state()
            seed(9)
            d = vescale.distribute_tensor(x.clone(), m, placements, src_data_rank=None)
            _C._rng_reset_drawn_elements()
            with torch.no_grad():
                got = fn(d)
            drawn = _C._rng_drawn_elements()
            local_want = vescale.distribute_tensor(want, m, placements, src_data_rank=None).to_local()
            where = f"rank {rank} {name} {dtype} {shape} {placements}"
            if not torch.equal(got.to_local(), local_want):
                failures.append(f"{where}: values")
            if not torch.equal(rng_state(), after):
                failures.append(f"{where}: generator state")
            local = d.to_local().numel()
            if cuda and isinstance(placements[0], Shard) and name in ("normal_", "dropout") and drawn != local:
                failures.append(f"{where}: drew {drawn} elements, the block has {local}")
    # a bad argument raises torch's own error and leaves the generator alone
    d = vescale.distribute_tensor(torch.empty(8, 8, device=device), m, [Shard(0)], src_data_rank=None)
    before = rng_state()
    with pytest.raises(RuntimeError, match="uniform_ expects"):
        d.uniform_(3.0, 1.0)
    if not torch.equal(rng_state(), before):
        failures.append(f"rank {rank}: a refused fill moved the generator")
    dist.destroy_process_group()
    assert failures == [], failures


def test_random_ops_on_two_ranks_draw_each_ranks_block_of_one_devices_values():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_random_ops_on_two_ranks, args=(2, port), nprocs=2)
