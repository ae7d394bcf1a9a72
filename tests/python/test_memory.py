"""Per-rank memory of each ZeRO stage on DP=4: parameter, gradient and optimizer-state
bytes (fp32 master weights included) must be the expected fraction of the model's."""

import pytest
import torch

from vescale.parallel import DDP, DistributedOptimizer

from dist_utils import mesh
from tests.models.gpt import GPT, GPTConfig

# (params, grads, optimizer state) as fractions of the parameter bytes P, for DP = 4.
# AdamW keeps two moments; with ZeRO the fp32 master copy counts as state: (1 + 2) / 4.
EXPECTED = {
    1: (1.0, 1.0, 0.75),
    2: (1.0, 0.25, 0.75),
    3: (0.25, 0.25, 0.75),
}
SLACK = 0.03  # per-parameter padding to a multiple of DP, and scalar step counters


def _case_memory(stage: int):
    m = mesh("1d4")
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(n_embd=64, n_layer=2, bias=False)), m)
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=stage, lr=1e-3)
    idx = torch.randint(0, 64, (1, 16))
    model(idx, idx).backward()
    after_backward = opt.memory_bytes()
    opt.step()
    after_step = opt.memory_bytes()
    return {"params": after_step["params"] / P, "grads": after_backward["grads"] / P,
            "optimizer_state": after_step["optimizer_state"] / P}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_memory_fractions(pool4, stage):
    want = dict(zip(("params", "grads", "optimizer_state"), EXPECTED[stage]))
    for got in pool4.run(_case_memory, stage):
        for key, fraction in want.items():
            assert abs(got[key] - fraction) <= SLACK, f"ZeRO-{stage} {key}: {got[key]:.3f} of the model, expected {fraction}"
