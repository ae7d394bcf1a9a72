"""vescale.generate_plan, the eager planner, part 1: the profile of an unmodified model, and
Megatron's column/row pairs found by what-if runs over virtual meshes for the project's
GPT and Llama and Hugging Face Llama / GPT-2 / Qwen2 (equal to the hand-written plans).
The search is in test_autoplan_search.py, the runs on 4 ranks in test_autoplan_ranks.py.
No timing is asserted: the machine is shared."""

import re

import pytest
import torch

from vescale import InterleavedShard, Replicate, Shard
from vescale.autoplan import profile_model, tensor_parallel_plan
from vescale.autoplan.virtual import placement_cost
from vescale.autoplan.whatif import unit_collectives
from vescale.parallel.plans import gpt2_plan, gpt_plan, hf_plan, llama_plan

from autoplan_models import BATCH, COMM, R, SEQ, VOCAB, gpt, hf, llama, tokens


# ---- the profile ----------------------------------------------------------------------------------

def test_profile_of_an_unmodified_gpt():
    model = gpt(bias=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    p = profile_model(model, tokens(), steps=1)
    assert [u.name for u in p.blocks_list] == [f"transformer.h.{i}" for i in range(4)]
    assert {u.name for u in p.units if u.kind == "pre"} == {"transformer.wte", "transformer.wpe"}
    assert {u.name for u in p.units if u.kind == "post"} == {"transformer.ln_f", "lm_head"}
    assert p.legal_cuts == [True, True, True]
    assert p.tied == [["transformer.wte.weight", "lm_head.weight"]]
    # execution order and nesting
    names = [n for n, _, _ in p.modules]
    assert names.index("transformer.h.0.attn.c_attn") < names.index("transformer.h.0.mlp.c_fc") < \
        names.index("transformer.h.1")
    assert dict((n, d) for n, d, _ in p.modules)["transformer.h.0.attn.c_attn"] == 5
    # the model splits c_attn's output into q, k, v: a fused linear
    fused = {lin.name: lin.fused for lin in p.linears}
    assert fused["transformer.h.0.attn.c_attn"] == 3 and fused["transformer.h.0.mlp.c_fc"] == 1
    block = p.blocks_list[0]
    assert block.param_bytes == sum(t.numel() * 4 for t in model.transformer.h[0].parameters())
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in block.ops and "aten::addmm" in block.ops
    assert block.at("saved", BATCH) > block.at("saved", 1) > 0
    assert block.at("out_bytes", BATCH) == BATCH * SEQ * 32 * 4  # what a pipeline sends on
    assert 0 < block.input_backward_share < 1
    assert block.at("forward", BATCH) > 0 and block.at("backward", BATCH) > 0
    assert block.at("flops", BATCH) == pytest.approx(2 * BATCH * SEQ * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 4 * BATCH * SEQ * SEQ * 32, rel=0.1)
    for n, t in model.named_parameters():  # profiling changed nothing
        assert torch.equal(t, before[n]) and t.grad is None


class _Skip(torch.nn.Module):
    """Blocks that all read the embedding: no cut is legal (the embedding needs gradients)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 16) for _ in range(3)])

    def forward(self, x, y):
        e = self.emb(x)
        h = e
        for b in self.blocks:
            h = b(torch.cat([h, e], -1))
        return torch.nn.functional.mse_loss(h, torch.zeros_like(h))


def test_profile_finds_illegal_cuts():
    p = profile_model(_Skip(), tokens(), steps=1)
    assert p.legal_cuts == [False, False]
    assert "need gradients" in p.cut_problems[0]


# ---- Megatron pairs found by what-if runs ---------------------------------------------------------

def _hand_placement(plan: dict, name: str):
    for pattern, placements in plan["parameter"].items():
        if re.fullmatch(pattern, name):
            return placements[0]
    return Replicate()


def _block_linears(model, blocks: str):
    first = model.get_submodule(blocks)[0]
    prefix = f"{blocks}.0."
    return [prefix + n for n, p in first.named_parameters() if p.dim() == 2]


CASES = {
    "gpt": (lambda: gpt(bias=True), lambda m: gpt_plan(), "tuple"),
    "llama": (llama, lambda m: llama_plan(), "tuple"),
    "hf-llama": (lambda: hf("hf-llama"), hf_plan, "hf"),
    "gpt2": (lambda: hf("gpt2"), lambda m: gpt2_plan(), "hf"),
    "qwen2": (lambda: hf("qwen2"), hf_plan, "hf"),
    "qwen2-no-cache": (lambda: hf("qwen2-no-cache"), hf_plan, "hf"),
}


def _batch(kind: str):
    x, y = tokens()
    return (x, y) if kind == "tuple" else {"input_ids": x, "labels": x}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_pairs_are_found(name, tp):
    make, hand_of, kind = CASES[name]
    model = make()
    batch = _batch(kind)
    prof = profile_model(model, batch, steps=1)
    choice = tensor_parallel_plan(prof, model, batch, tp, COMM)
    assert choice.feasible, choice.problems
    found, hand = choice.plan(), hand_of(model)
    for weight in _block_linears(model, prof.blocks):
        assert _hand_placement(found, weight) == _hand_placement(hand, weight), (weight, choice.describe())
    # and every layer of every block follows (the cluster's plan is written for all of them)
    for name_, p in model.named_parameters():
        if p.dim() == 2 and name_.startswith(prof.blocks + "."):
            assert _hand_placement(found, name_) == _hand_placement(hand, name_), name_
    # the whole model as the rules run it, the embedding and head split as the hand plan
    # splits them (the search chooses those separately): the blocks' collectives cost no
    # more than under the hand plan
    ends = {}
    for w in choice.end_modules:  # a tied weight is one tensor: the placement of any of its names
        names = next((g for g in prof.tied if w in g), [w])
        ends[w] = next((_hand_placement(hand, n) for n in names if _hand_placement(hand, n) != Replicate()),
                       Replicate())
    ours = unit_collectives(prof, model, batch, choice.plan(ends={w: p for w, p in ends.items() if p != R}),
                            tp, False).per_unit
    theirs = unit_collectives(prof, model, batch, hand, tp, False).per_unit

    def blocks_cost(per):
        return sum(placement_cost(per[u.name]["forward"] + per[u.name]["backward"], COMM) for u in prof.blocks_list)
    assert blocks_cost(ours) <= blocks_cost(theirs) * (1 + 1e-9), (ours, theirs)



@pytest.mark.parametrize("name", ["gpt", "llama", "qwen2-no-cache"])
@pytest.mark.parametrize("sp", [False, True])
def test_what_ifs_are_the_same_on_meta_and_on_real_tensors(name, sp):
    """The planner runs its what-ifs on real local tensors where that is cheaper than on
    meta: the same plan, each region's layouts tried with the same collectives and the
    same runner-up; per unit of the whole model the same collectives (kind, group size,
    bytes), parameter bytes, Partial gradient bytes and bytes a split backward keeps."""
    from vescale.autoplan.split_backward import sharded_held_for_weights
    make, _, kind = CASES[name]
    model = make()
    batch = _batch(kind)
    prof = profile_model(model, batch, steps=1)
    choices = [tensor_parallel_plan(prof, model, batch, 2, COMM, sequence_parallel=sp, real=real)
               for real in (False, True)]
    assert choices[0].plan() == choices[1].plan()
    for on_meta, on_real in zip(*(c.regions for c in choices)):
        assert (on_real.events, on_real.tried, on_real.failed) == (on_meta.events, on_meta.tried, on_meta.failed)
        assert on_real.runner_up == on_meta.runner_up
    plan = choices[0].plan()
    on_meta, on_real = (unit_collectives(prof, model, batch, plan, 2, sp, real=real) for real in (False, True))
    assert on_real.per_unit == on_meta.per_unit
    assert on_real.param_bytes == on_meta.param_bytes and on_real.partial_bytes == on_meta.partial_bytes
    held = [sharded_held_for_weights(prof, model, batch, plan, 2, real=real) for real in (False, True)]
    assert held[0] == held[1] and held[0]
    # the model itself is left as it was: plain parameters, no gradients
    assert all(type(p) is torch.nn.Parameter and p.grad is None for p in model.parameters())

def test_fused_qkv_is_split_within_its_blocks():
    """nanoGPT's c_attn holds q, k and v: InterleavedShard(0, 3) beats a plain Shard(0),
    which would make the split gather them."""
    model = gpt()
    prof = profile_model(model, tokens(), steps=1)
    choice = tensor_parallel_plan(prof, model, tokens(), 2, COMM)
    attn = next(r for r in choice.regions if r.region.endswith("attn"))
    placements = {lin.name.rsplit(".", 1)[-1]: p for lin, p in attn.assignment}
    assert placements == {"c_attn": InterleavedShard(0, 3), "c_proj": Shard(1)}
    assert attn.runner_up is not None and attn.runner_up[1] > attn.cost_s
