"""Tensor-parallel Partial gradients reduced in buckets (vescale/parallel/tp_grads.py):
how many collectives one backward issues, over which groups, and that the gradients
still equal a single-device run's (to 1e-5 of each tensor's largest element) and
carry their parameters' placements. Training parity over several steps with these
reductions is test_parallel.py's."""

from __future__ import annotations

import collections

import pytest
import torch

import vescale
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.plans import gpt_plan

from dist_utils import full_grads, mesh, mismatch_to_max
from examples.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(bias=True)  # biases and LayerNorms: replicated parameters with Partial gradients


def _batch(rows: int):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CONFIG.vocab_size, (rows, 16), generator=g)


def _reference_grads(rows: int, micro: int = 1) -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    idx = _batch(rows)
    for part in idx.chunk(micro):
        (model(part, part) / micro).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _all_reduces(trace) -> collections.Counter:
    return collections.Counter((e["source"], e["group_size"]) for e in trace.events if e["kind"] == "all_reduce")


def _problems(model, ref) -> list[str]:
    inner = model.module if isinstance(model, DDP) else model
    out = [f"{n}: gradient {p.grad.placements} but parameter {p.placements}"
           for n, p in inner.named_parameters() if p.grad is not None and p.grad.placements != p.placements]
    for name, grad in full_grads(model).items():
        err = mismatch_to_max(grad, ref[name])
        if err:
            out.append(f"{name}: {err}")
    return out


def _layer_norm_bytes(model) -> int:
    """LayerNorms run on sequence shards under SP: their gradients are Partial sums."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".ln_" in n)


def _case_tp4(deferred: bool):
    torch.manual_seed(0)
    model = vescale.deferred_init(GPT, CONFIG) if deferred else GPT(CONFIG)
    parallelize_module(model, mesh("1d4"), gpt_plan(sequence_parallel=True))
    if deferred:
        vescale.materialize_module(model)
    idx = _batch(2)
    loss = model(idx, idx)
    with vescale.debug.comm_trace() as t:
        loss.backward()
    return _all_reduces(t), _layer_norm_bytes(model), [e["bytes"] for e in t.events if e["source"] == "tp"], \
        _problems(model, _reference_grads(2))


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred_init"])
def test_tp4_reduces_every_replicated_gradient_in_one_collective(pool4, deferred):
    """GPT with sequence parallelism on 4 ranks: its 2 LayerNorms per block, the final
    one and the row-parallel biases got one all-reduce each before; now one in all."""
    for counts, layer_norms, tp_bytes, problems in pool4.run(_case_tp4, deferred):
        assert problems == []
        assert counts == {("tp", 4): 1}  # and no all-reduce by the engine
        assert len(tp_bytes) == 1 and tp_bytes[0] >= layer_norms > 0


def _case_dp2_tp2(zero: int, micro: int):
    m = mesh("2d")
    torch.manual_seed(0)
    model = GPT(CONFIG)
    parallelize_module(model, m["TP"], gpt_plan(sequence_parallel=True))
    model = DDP(model, m["DP"])
    if zero:
        DistributedOptimizer(torch.optim.SGD, [model], zero_stage=zero, lr=0.1)
    rows = _batch(4).chunk(2)[m.get_local_rank("DP")].chunk(micro)
    placements_between, counts_between = [], collections.Counter()
    for i, idx in enumerate(rows):
        loss = model(idx, idx) / micro
        last = i == micro - 1
        with vescale.debug.comm_trace() as t:
            if last:
                loss.backward()
            else:
                with model.no_sync():
                    loss.backward()
        if not last:
            counts_between += _all_reduces(t)
            placements_between.append(str(model.module.transformer.ln_f.weight.grad.placements))
    return _all_reduces(t), counts_between, placements_between, _problems(model, _reference_grads(4, micro))


@pytest.mark.parametrize("zero,micro", [(0, 1), (0, 2), (2, 1)], ids=["ddp", "ddp-no_sync", "zero2"])
def test_dp2_tp2_composes_tensor_and_data_parallel_reductions(pool4, zero, micro):
    """Under DDP on a 2x2 mesh the Partial gradients are summed over DP x TP (the world)
    by one all-reduce, beside DDP's one over DP for the rest. Under no_sync they stay
    Partial (no collective) until the step that reduces. ZeRO-2 sums its slices over TP
    (one all-reduce of a DP slice) after the reduce-scatter."""
    for counts, between, placements, problems in pool4.run(_case_dp2_tp2, zero, micro):
        assert problems == []
        assert between == collections.Counter()
        assert placements == ["(Partial(sum),)"] * (micro - 1)
        if zero:
            assert counts == {("tp", 2): 1}
        else:
            assert counts == {("ddp", 2): 1, ("tp", 4): 1}


def _case_gradients_kept_between_steps():
    """zero_grad(set_to_none=False): the next gradient is added into a Replicate one; the
    engine reduces it first (per parameter) and the values stay right."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    parallelize_module(model, mesh("1d4"), gpt_plan(sequence_parallel=True))
    idx = _batch(2)
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        model(idx, idx).backward()
    return _problems(model, _reference_grads(2))


def test_gradients_kept_between_steps(pool4):
    for problems in pool4.run(_case_gradients_kept_between_steps):
        assert problems == []
