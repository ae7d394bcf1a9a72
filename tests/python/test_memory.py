"""Per-rank memory of each ZeRO stage on DP=4: parameter, gradient, master-weight and
optimizer-state bytes must be the expected fractions of the model's; and nothing of a
training step outlives it."""

import pytest
import torch

from vescale.parallel import DDP, DistributedOptimizer

from dist_utils import mesh
from examples.models.gpt import GPT, GPTConfig

# (params, grads, master, optimizer state) as fractions of the parameter bytes P, for
# DP = 4. AdamW keeps two fp32 moments per element of the slice: 2/4 of P for fp32
# parameters, 2 * 2/4 for bf16. fp32 parameters are their own master weights (ZeRO-1/2:
# the master slice is a view of the parameter; ZeRO-3: the parameter's slice is the
# master): 0. bf16 parameters get an fp32 master slice: 2/4 of P.
EXPECTED = {
    (1, torch.float32): (1.0, 1.0, 0.0, 0.5),
    (2, torch.float32): (1.0, 0.25, 0.0, 0.5),
    (3, torch.float32): (0.25, 0.25, 0.0, 0.5),
    (2, torch.bfloat16): (1.0, 0.25, 0.5, 1.0),
    (3, torch.bfloat16): (0.25, 0.25, 0.5, 1.0),
}
KEYS = ("params", "grads", "master", "optimizer_state")
SLACK = 0.03  # per-parameter padding to a multiple of DP, and scalar step counters


def _case_memory(stage: int, dtype: torch.dtype):
    m = mesh("1d4")
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(n_embd=64, n_layer=2, bias=False)).to(dtype), m)
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=stage, lr=1e-3)
    idx = torch.randint(0, 64, (1, 16))
    model(idx, idx).backward()
    after_backward = opt.memory_bytes()
    opt.step()
    after_step = opt.memory_bytes()
    return {"params": after_step["params"] / P, "grads": after_backward["grads"] / P,
            "master": after_step["master"] / P, "optimizer_state": after_step["optimizer_state"] / P}


@pytest.mark.parametrize("stage,dtype", list(EXPECTED), ids=[f"zero{s}-{str(d)[6:]}" for s, d in EXPECTED])
def test_zero_memory_fractions(pool4, stage, dtype):
    want = dict(zip(KEYS, EXPECTED[stage, dtype]))
    for got in pool4.run(_case_memory, stage, dtype):
        for key, fraction in want.items():
            assert abs(got[key] - fraction) <= SLACK, f"ZeRO-{stage} {key}: {got[key]:.3f} of the model, expected {fraction}"


# ---- nothing outlives a step ------------------------------------------------------------------

def _case_live_dtensors(plan_name: str) -> list[int]:
    """DTensors alive after each of 5 training steps (forward, backward, AdamW, zero_grad)."""
    from vescale import _C
    from vescale.parallel import parallelize_module
    from vescale.parallel.plans import gpt_plan

    m = mesh("2d" if plan_name.startswith("dp2") else "1d4")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=64, n_head=4, n_layer=2, block_size=16, vocab_size=64, bias=False))
    tp = m["TP"] if plan_name.startswith("dp2") else m
    parallelize_module(model, tp, gpt_plan(sequence_parallel=plan_name.endswith("sp")))
    if plan_name.startswith("dp2"):
        model = DDP(model, m["DP"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    live = []
    for _ in range(5):
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        live.append(_C._live_dtensors())
    return live


@pytest.mark.parametrize("plan_name", ["tp4", "tp4-sp", "dp2-tp2"])
def test_training_steps_leave_no_dtensors_behind(pool4, plan_name):
    """A Partial input reduced inside an op (Megatron TP without sequence parallelism
    reduces the row-parallel outputs this way) used to leak its shard every step: the
    registry of kept reductions held the dead DTensor weakly, which kept its shard, whose
    storage was the registry's own key. The count of live DTensors must stay put once
    AdamW has made its state (after the first step)."""
    for live in pool4.run(_case_live_dtensors, plan_name):
        assert live[1:] == [live[1]] * 4, live
