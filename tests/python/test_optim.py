"""Unchanged torch.optim optimizers (single-tensor, foreach and fused kernels) and
gradient clipping on DTensor parameters match the same steps on plain tensors."""

import pytest
import torch

from vescale import Replicate, Shard

from dist_utils import make_dtensor, mesh, mismatch, rand

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, fused=True),
    "adam_amsgrad_foreach": lambda p: torch.optim.Adam(p, lr=0.05, amsgrad=True, foreach=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd_momentum_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
}

# (shape, placements on the 2x2 mesh): sharded, replicated, nested and uneven parameters
PARAMS = [
    ((6, 4), [Replicate(), Shard(0)]),
    ((5, 3), [Shard(1), Replicate()]),
    ((7,), [Replicate(), Replicate()]),
    ((4, 6), [Shard(0), Shard(0)]),
]


def _loss(params, x):
    w1, w2, b, w3 = params
    h = torch.tanh(x @ w1[:, :4].t() + b[:6].sum())  # (8, 6)
    return (h @ w3.t()).pow(2).mean() + w2.pow(2).sum() * 0.1


def _case_optimizer(name: str, clip: str | None):
    m = mesh("2d")
    fulls = [rand(shape, seed=10 + i) for i, (shape, _) in enumerate(PARAMS)]
    ref = [f.clone().requires_grad_() for f in fulls]
    dist = [make_dtensor(f, m, p, requires_grad=True) for f, (_, p) in zip(fulls, PARAMS)]
    ref_opt, opt = OPTIMIZERS[name](ref), OPTIMIZERS[name](dist)
    x = rand((8, 4), seed=5)
    failures = []
    for step in range(3):
        for params, o in ((ref, ref_opt), (dist, opt)):
            o.zero_grad()
            _loss(params, x).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=clip == "foreach")
            o.step()
        for k, (r, d) in enumerate(zip(ref, dist)):
            err = mismatch(d.full_tensor(), r.detach(), rtol=1e-6, atol=1e-8)
            if err:
                failures.append(f"step {step}, param {k}: {err}")
            if list(d.placements) != PARAMS[k][1]:
                failures.append(f"step {step}, param {k} moved to {d.placements}")
    return failures


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_plain(pool4, name):
    for failures in pool4.run(_case_optimizer, name, None):
        assert failures == []


@pytest.mark.parametrize("clip", ["foreach", "loop"])
def test_clip_grad_norm_matches_plain(pool4, clip):
    for failures in pool4.run(_case_optimizer, "adamw", clip):
        assert failures == []
