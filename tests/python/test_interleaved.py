"""InterleavedShard(dim, groups): a fused projection (q|k|v, gate|up) split within each
of its blocks. Every redistribution to and from it on 1-d and 2-d meshes, checked
shard by shard against a layout computed here by hand; fused attention and the GPT
under TP against single device, with the collectives counted; checkpoints, deferred
init and the errors for layouts it cannot take."""

import pytest
import torch
import torch.nn.functional as F

import vescale
from vescale import InterleavedShard, Partial, Replicate, Shard
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.plans import gpt_plan

from dist_utils import describe, make_dtensor, mesh, mismatch, rand, training_mismatches
from examples.models.gpt import GPT, GPTConfig


def expected_local(full: torch.Tensor, placements, m) -> torch.Tensor:
    """This rank's shard, from the definitions: Shard(d) takes torch.chunk-sized block c;
    InterleavedShard(d, g) sees d as (g, k, piece) and takes piece c of every block."""
    x = full
    for md, p in enumerate(placements):
        k, c = m.shape[md], m.get_coordinate()[md]
        if isinstance(p, Shard):
            n = x.shape[p.dim]
            step = -(-n // k)
            x = x.narrow(p.dim, min(c * step, n), max(0, min(step, n - c * step)))
        elif isinstance(p, InterleavedShard):
            d, g = p.dim, p.groups
            x = x.unflatten(d, (g, k, x.shape[d] // (g * k))).select(d + 1, c).flatten(d, d + 1)
    return x


def _valid(placements, shape, m) -> bool:
    for md, p in enumerate(placements):
        if isinstance(p, InterleavedShard):
            if shape[p.dim] % (p.groups * m.shape[md]):
                return False
            if any(q.splits() and q.dim == p.dim for j, q in enumerate(placements) if j != md):
                return False
    return True


def _case_transitions(mesh_name: str):
    m = mesh(mesh_name)
    if m.get_coordinate() is None:  # a rank outside a smaller mesh
        return []
    shape = (12, 4)
    full = rand(shape, seed=3)
    per_dim = [Replicate(), Shard(0), Shard(1), Partial(), InterleavedShard(0, 3), InterleavedShard(0, 2),
               InterleavedShard(1, 2)]
    options = [[p] for p in per_dim] if m.ndim == 1 else [[a, b] for a in per_dim for b in per_dim]
    failures = []
    for src in options:
        if not _valid(src, shape, m):
            continue
        # Sources with an interleaved dim are cut from a replicated one (itself a step under test).
        base = [Replicate() if p.is_interleaved() else p for p in src]
        x = make_dtensor(full, m, base, seed=2).redistribute(m, src)
        for dst in options:
            if not _valid(dst, shape, m):
                with pytest.raises(ValueError, match="InterleavedShard"):
                    x.redistribute(m, dst)
                continue
            y = x.redistribute(m, dst)
            if tuple(y.placements) != tuple(dst):
                failures.append(f"{describe(src)} -> {describe(dst)}: placements {y.placements}")
                continue
            if not any(p.is_partial() for p in dst):
                err = mismatch(y.to_local(), expected_local(full, dst, m))
                if err:
                    failures.append(f"{describe(src)} -> {describe(dst)}: local shard {err}")
            err = mismatch(y.full_tensor(), full)
            if err:
                failures.append(f"{describe(src)} -> {describe(dst)}: {err}")
    return failures


@pytest.mark.parametrize("mesh_name", ["1d2", "1d4", "2d"])
def test_every_transition_keeps_the_value(pool4, mesh_name):
    for failures in pool4.run(_case_transitions, mesh_name):
        assert failures == []


# ---- fused attention ---------------------------------------------------------------------------

B, T, C, H = 2, 5, 16, 4


def _attention(w, b, x):
    """nanoGPT's attention with a fused c_attn (nn.Linear weight (3C, C))."""
    q, k, v = F.linear(x, w, b).split(C, dim=2)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).contiguous().view(B, T, C)


def _case_attention(mesh_name: str, placement) -> tuple[list[str], dict]:
    m = mesh(mesh_name)
    if m.get_coordinate() is None:
        return [], None
    tp = [Replicate()] * (m.ndim - 1)
    w, b, x = rand((3 * C, C), seed=1), rand((3 * C,), seed=2), rand((B, T, C), seed=3)
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = _attention(ref_w, ref_b, x)
    (ref * rand(ref.shape, seed=4)).sum().backward()
    dw = vescale.distribute_tensor(w, m, tp + [placement]).requires_grad_()
    db = vescale.distribute_tensor(b, m, tp + [placement]).requires_grad_()
    dx = vescale.distribute_tensor(x, m, [Replicate()] * m.ndim)
    vescale.reset_collective_counts()
    vescale.reset_fallback_counts()
    out = _attention(dw, db, dx)
    heads_local = out.placements[-1]
    # (every rank holds the same cotangent: no broadcast from a source rank)
    (out * vescale.distribute_tensor(rand(ref.shape, seed=4), m, out.placements, src_data_rank=None)).sum().backward()
    counts = vescale.collective_counts()
    failures = []
    if vescale.fallback_counts():
        failures.append(f"fallbacks {vescale.fallback_counts()}")
    for name, got, want in [("output", out.full_tensor(), ref), ("weight grad", dw.grad.full_tensor(), ref_w.grad),
                            ("bias grad", db.grad.full_tensor(), ref_b.grad)]:
        err = mismatch(got, want, rtol=1e-10, atol=1e-12)
        if err:
            failures.append(f"{name}: {err}")
    if placement.is_interleaved() and (dw.grad.placements != dw.placements or db.grad.placements != db.placements):
        failures.append(f"gradients {dw.grad.placements}, {db.grad.placements}: not the parameters' layout")
    return failures, {"counts": counts, "out": heads_local}


@pytest.mark.parametrize("mesh_name", ["1d2", "1d4", "2d"])
def test_fused_attention_runs_heads_locally(pool4, mesh_name):
    """InterleavedShard(0, 3) on c_attn: the split into q, k, v gives every rank its own
    heads, so forward and backward send nothing; Shard(0) gathers (one rank would hold
    all of q). Both match single device."""
    interleaved = pool4.run(_case_attention, mesh_name, InterleavedShard(0, 3))
    plain = pool4.run(_case_attention, mesh_name, Shard(0))
    for (failures, info), (plain_failures, plain_info) in zip(interleaved, plain):
        assert failures == [] and plain_failures == []
        if info is None:
            continue
        assert info["out"] == Shard(2)  # the attention output stays split by heads
        assert sum(calls for calls, _ in info["counts"].values()) == 0, info["counts"]
        assert plain_info["counts"]["all_gather"][0] > 0, plain_info["counts"]


# ---- the GPT under TP ----------------------------------------------------------------------------

def _gpt_step_counts(plan: dict, steps: int = 3):
    """Losses, first-step gradients and the collectives of one training step of the GPT
    under ``plan`` on a 2-rank TP mesh."""
    m = mesh("1d2")
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0, bias=True))
    parallelize_module(model, m, plan)
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 64, (4, 17), generator=g) for _ in range(steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads, counts = [], None, None
    for d in data:
        opt.zero_grad()
        vescale.reset_collective_counts()
        loss = model(d[:, :-1].contiguous(), d[:, 1:].contiguous())
        loss.backward()
        counts = counts or vescale.collective_counts()
        if grads is None:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item())
    return losses, grads, counts


def _case_gpt() -> tuple[list[str], dict, dict]:
    interleaved = gpt_plan()
    plain = gpt_plan()
    plain["parameter"] = {k: ([Shard(0)] if "c_attn" in k else v) for k, v in plain["parameter"].items()}
    losses, grads, counts = _gpt_step_counts(interleaved)
    _, _, plain_counts = _gpt_step_counts(plain)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(dropout=0.0, bias=True))
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 64, (4, 17), generator=g) for _ in range(3)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses, ref_grads = [], None
    for d in data:
        opt.zero_grad()
        loss = ref(d[:, :-1].contiguous(), d[:, 1:].contiguous())
        loss.backward()
        ref_grads = ref_grads or {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        ref_losses.append(loss.item())
    return training_mismatches(losses, ref_losses, grads, ref_grads), counts, plain_counts


def test_gpt_plan_splits_heads_without_gathering(pool2):
    """gpt_plan's c_attn is InterleavedShard(0, 3): training matches single device, and a
    step sends one all-gather fewer per layer forward (q|k|v) and one fewer backward (the
    gradient of q|k|v came back whole and was cut again) than with Shard(0)."""
    layers = GPTConfig().n_layer
    for failures, counts, plain_counts in pool2.run(_case_gpt):
        assert failures == []
        gathers, plain_gathers = counts["all_gather"][0], plain_counts["all_gather"][0]
        assert gathers <= plain_gathers - layers, (counts, plain_counts)
        assert counts["all_gather"][1] < plain_counts["all_gather"][1]


# ---- checkpoints and deferred init -----------------------------------------------------------

def _case_checkpoint(path: str) -> list[str]:
    """Saved under InterleavedShard (with ZeRO-2 slices of the optimizer state on a DP x TP
    mesh), loaded into plain Shard(0) and into a replicated model: the same values."""
    m = mesh("2d")
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0, bias=True))
    parallelize_module(model, m["TP"], gpt_plan())
    model = DDP(model, m["DP"])
    opt = DistributedOptimizer(torch.optim.SGD, models=[model], zero_stage=2, lr=1e-2, momentum=0.9)
    d = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    model(d[:, :-1].contiguous(), d[:, 1:].contiguous()).backward()
    opt.step()
    vescale.save(path, {"model": model, "optimizer": opt})
    want = {n: p.full_tensor() for n, p in model.named_parameters()}
    failures = []
    for layout in ("shard", "replicate"):
        torch.manual_seed(1)
        other = GPT(GPTConfig(dropout=0.0, bias=True))
        plan = gpt_plan()
        if layout == "shard":
            plan["parameter"] = {k: ([Shard(0)] if "c_attn" in k else v) for k, v in plan["parameter"].items()}
        else:
            plan["parameter"] = {}
        parallelize_module(other, m["TP"], plan)
        other = DDP(other, m["DP"])
        other_opt = DistributedOptimizer(torch.optim.SGD, models=[other], zero_stage=1, lr=1e-2, momentum=0.9)
        vescale.load(path, {"model": other, "optimizer": other_opt})
        for n, p in other.named_parameters():
            err = mismatch(p.full_tensor(), want[n], rtol=0, atol=0)
            if err:
                failures.append(f"{layout}: {n}: {err}")
        # The optimizer state (momentum) resharded too: one more identical step on both
        # sides. (SGD: Adam would turn rounding noise in near-zero gradients into lr-sized steps.)
        for mdl, o in ((model, opt), (other, other_opt)):
            o.zero_grad()
            mdl(d[:, :-1].contiguous(), d[:, 1:].contiguous()).backward()
            o.step()
        for n, p in other.named_parameters():
            err = mismatch(p.full_tensor(), dict(model.named_parameters())[n].full_tensor(), rtol=1e-5, atol=1e-6)
            if err:
                failures.append(f"{layout}, one step after loading: {n}: {err}")
        vescale.load(path, {"model": model, "optimizer": opt})  # back to the saved state
    return failures


def test_checkpoint_round_trips_across_layouts(pool4, tmp_path):
    for failures in pool4.run(_case_checkpoint, str(tmp_path / "ckpt")):
        assert failures == []


def _case_deferred() -> list[str]:
    m = mesh("1d2")
    torch.manual_seed(0)
    eager = GPT(GPTConfig(bias=True))
    torch.manual_seed(0)
    lazy = vescale.deferred_init(GPT, GPTConfig(bias=True))
    parallelize_module(lazy, m, gpt_plan())
    failures = []
    for (n, p), q in zip(lazy.named_parameters(), eager.parameters()):
        err = mismatch(p.full_tensor(), q.detach(), rtol=0, atol=0)
        if err:
            failures.append(f"{n} ({p.placements}): {err}")
    return failures


def test_deferred_init_builds_each_rank_its_pieces(pool2):
    for failures in pool2.run(_case_deferred):
        assert failures == []


# ---- errors ------------------------------------------------------------------------------------

def _case_errors() -> list[str]:
    m2, m = mesh("2d"), mesh("1d4")
    x = rand((12, 4), seed=1)
    seen = []
    for placements, mesh_, match in [
        ([InterleavedShard(0, 5)], m, r"InterleavedShard\(0, 5\).*size 12.*5 x 4 equal pieces"),
        ([InterleavedShard(1, 3)], m, r"InterleavedShard\(1, 3\).*size 4"),
        ([Shard(0), InterleavedShard(0, 3)], m2, r"split the same tensor dim.*cannot nest"),
        ([InterleavedShard(2, 3)], m, r"out of range"),
    ]:
        try:
            vescale.distribute_tensor(x, mesh_, placements)
            seen.append(f"{placements}: no error")
        except (ValueError, IndexError) as e:
            import re
            if not re.search(match, str(e)):
                seen.append(f"{placements}: {e}")
    y = vescale.distribute_tensor(x, m, [InterleavedShard(0, 3)])  # the process goes on
    if mismatch(y.full_tensor(), x):
        seen.append("a good layout after the errors is wrong")
    return seen


def test_layouts_it_cannot_take_are_clear_errors(pool4):
    for failures in pool4.run(_case_errors):
        assert failures == []
    with pytest.raises(ValueError, match=r"2 <= groups.*Shard\(0\)"):
        InterleavedShard(0, 1)
    with pytest.raises(TypeError):
        InterleavedShard(0, "3")


def test_plan_text_and_pipeline_header_carry_it():
    from vescale.plan import parse_placement, placement_text
    from vescale.parallel.pipeline.p2p import _placement_of_word, _placement_word
    p = InterleavedShard(1, 3)
    assert parse_placement(placement_text(p), "k") == p
    assert parse_placement("InterleavedShard(dim=0, groups=2)", "k") == InterleavedShard(0, 2)
    for q in (p, InterleavedShard(0, 63), Shard(0), Shard(5), Replicate()):
        assert _placement_of_word(_placement_word(q)) == q
