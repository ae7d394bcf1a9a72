"""Training steps of the GPT and Llama test models on a 2x2 (DP x TP) mesh with
hand-written Megatron placements: losses, first-step gradients and (within Adam's
reach, see dist_utils) parameters match single-device training, and every op the steps
dispatch has a real rule (nothing goes through the fallback)."""

import re

import pytest
import torch

import vescale
from vescale import Replicate, Shard

from dist_utils import adam_mismatch, full_grads, mesh, mismatch, mismatch_to_max
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM

# (model factory, TP placement per parameter-name pattern; anything else replicated).
# GPT without biases: the key bias of attention has an exactly zero gradient in exact
# arithmetic (softmax ignores a shift), so its computed gradient is pure rounding noise,
# which neither a gradient comparison nor AdamW's steps on it can judge.
MODELS = {
    "gpt": (lambda: GPT(GPTConfig(dropout=0.1, bias=False)), {
        r".*attn\.c_attn\.(weight|bias)": Shard(0), r".*attn\.c_proj\.weight": Shard(1),
        r".*mlp\.c_fc\.(weight|bias)": Shard(0), r".*mlp\.c_proj\.weight": Shard(1),
        r"lm_head\.weight": Shard(0),  # tied with wte: a vocabulary-parallel embedding
    }),
    "llama": (lambda: LlamaForCausalLM(LlamaConfig()), {
        r".*(q|k|v)_proj\.weight": Shard(0), r".*o_proj\.weight": Shard(1),
        r".*(gate|up)_proj\.weight": Shard(0), r".*down_proj\.weight": Shard(1),
        r"lm_head\.weight": Shard(0),
    }),
}


def _tp_placement(name: str, plan: dict):
    for pattern, placement in plan.items():
        if re.fullmatch(pattern, name):
            return placement
    return Replicate()


def _distribute(model: torch.nn.Module, m, plan: dict) -> None:
    done = {}
    for mod_name, module in model.named_modules():
        for p_name, param in list(module.named_parameters(recurse=False)):
            full_name = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(param) not in done:
                placements = [Replicate(), _tp_placement(full_name, plan)]
                done[id(param)] = torch.nn.Parameter(vescale.distribute_tensor(param.data, m, placements))
            setattr(module, p_name, done[id(param)])


LR = 1e-2


def _train(model, batches, seed: int):
    """Losses of every step and the first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    torch.manual_seed(seed)  # the dropout draws, alike on every rank and on the reference
    for idx, targets in batches:
        opt.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        if grads is None:
            grads = full_grads(model)
        opt.step()
        losses.append(loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item())
    return losses, grads


def _case_model(name: str):
    factory, plan = MODELS[name]
    m = mesh("2d")
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 64, (4, 17), generator=g) for _ in range(3)]
    plain_batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    torch.manual_seed(0)
    ref = factory()
    torch.manual_seed(0)
    model = factory()
    _distribute(model, m, plan)
    batches = [(vescale.distribute_tensor(i, m, [Shard(0), Replicate()]),
                vescale.distribute_tensor(t, m, [Shard(0), Replicate()])) for i, t in plain_batches]
    vescale.reset_fallback_counts()
    losses, grads = _train(model, batches, seed=1)
    fallbacks = vescale.fallback_counts()
    ref_losses, ref_grads = _train(ref, plain_batches, seed=1)
    failures = []
    if fallbacks:
        failures.append(f"ops through the fallback: {fallbacks}")
    err = mismatch(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    if err:
        failures.append(f"losses {losses} vs {ref_losses}: {err}")
    for pname, g in grads.items():
        err = mismatch_to_max(g, ref_grads[pname])
        if err:
            failures.append(f"first-step gradient of {pname}: {err}")
    ref_params = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        err = adam_mismatch(p.full_tensor(), ref_params[pname].detach(), lr=LR, steps=len(batches))
        if err:
            failures.append(f"{pname}: {err}")
    return failures


@pytest.mark.parametrize("name", list(MODELS))
def test_model_training_matches_single_device(pool4, name):
    for failures in pool4.run(_case_model, name):
        assert failures == []


def _sample_top_k(model, idx, steps: int, top_k: int):
    """nanoGPT's generate(temperature=0.8, top_k=...): the probabilities of every step and
    the tokens drawn from them (on plain tensors, with one seeded generator per step)."""
    probs_seen = []
    for step in range(steps):
        logits = model(idx)[:, -1, :] / 0.8
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")  # index_put_ with a bool mask and a 0-d value
        probs = torch.softmax(logits, dim=-1)
        probs = probs.full_tensor() if isinstance(probs, vescale.DTensor) else probs
        probs_seen.append(probs)
        idx_next = torch.multinomial(probs, num_samples=1, generator=torch.Generator().manual_seed(step))
        idx = torch.cat((idx, idx_next), dim=1)
    return probs_seen, idx


def _case_generate(name: str):
    factory, plan = MODELS[name]
    m = mesh("2d")
    torch.manual_seed(0)
    ref = factory().eval()
    torch.manual_seed(0)
    model = factory().eval()
    _distribute(model, m, plan)
    start = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        probs, tokens = _sample_top_k(model, start, steps=6, top_k=5)
        ref_probs, ref_tokens = _sample_top_k(ref, start, steps=6, top_k=5)
    failures = [f"step {k}: {e}" for k, (p, q) in enumerate(zip(probs, ref_probs))
                if (e := mismatch(p, q, rtol=1e-5, atol=1e-6))]
    if not torch.equal(tokens, ref_tokens):
        failures.append(f"tokens {tokens.tolist()} vs {ref_tokens.tolist()}")
    return failures


def test_gpt_generate_top_k_matches_single_device(pool4):
    """nanoGPT's sampling loop on the tensor-parallel GPT (vocabulary-parallel logits):
    once a crash in index_put with a 0-d value."""
    for failures in pool4.run(_case_generate, "gpt"):
        assert failures == []
