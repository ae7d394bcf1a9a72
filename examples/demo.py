"""Train a tiny transformer on a 2x2 (DP x TP) mesh with hand-written placements.

    .venv/bin/torchrun --standalone --nproc-per-node 4 examples/demo.py

Every rank builds the same model (seed 0), its parameters are distributed by hand
(Megatron-style tensor parallelism on "TP", replication on "DP"), the batch is split
over "DP", and a few AdamW steps run with the usual, unchanged training loop. The
per-step losses are then compared with a plain single-process run of the same model on
the same data; the script exits non-zero when they differ.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vescale  # noqa: E402
from vescale import Replicate, Shard  # noqa: E402
from tiny_transformer import Config, TinyTransformer  # noqa: E402

STEPS = 5
BATCH = 4
LR = 1e-2
RTOL = 1e-4  # max relative difference of the losses allowed (float32)


def tp_placement(module_name: str, param_name: str):
    """Megatron-style placement on the TP mesh dim for one parameter."""
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in ("q", "k", "v", "fc1"):          # column parallel: split the output features
        return Shard(0)
    if leaf in ("proj", "fc2"):                 # row parallel: split the input features
        return Shard(1) if param_name == "weight" else Replicate()
    return Replicate()                          # embeddings, LayerNorms, lm_head


def distribute_model(model: nn.Module, mesh: vescale.DeviceMesh) -> dict[str, tuple]:
    """Replaces every parameter in place by a DTensor; returns name -> placements."""
    plan, done = {}, {}  # done: id(plain param) -> its DTensor, so tied weights stay tied
    for mod_name, module in model.named_modules():
        for p_name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in done:
                placements = [Replicate(), tp_placement(mod_name, p_name)]
                done[id(param)] = nn.Parameter(vescale.distribute_tensor(param.data, mesh, placements))
                plan[f"{mod_name}.{p_name}" if mod_name else p_name] = tuple(placements)
            setattr(module, p_name, done[id(param)])
    return plan


def make_batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Next-token batches, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        data = torch.randint(cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


def train(model: nn.Module, batches, log=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for step, (idx, targets) in enumerate(batches):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        value = loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item()
        dt = time.perf_counter() - t0
        losses.append(value)
        if log:
            log(f"  step {step}  loss {value:.6f}  {dt * 1e3:8.1f} ms")
    return losses


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    if world != 4:
        log(f"this demo needs 4 ranks (got {world}): torchrun --standalone --nproc-per-node 4 examples/demo.py")
        dist.destroy_process_group()
        return 2

    cfg = Config()
    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    log(f"mesh: {mesh}")
    log(f"model: {cfg}")

    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    plan = distribute_model(model, mesh)
    log("placements [DP, TP]:")
    for name, pl in plan.items():
        if name.startswith("blocks.") and not name.startswith("blocks.0."):
            continue
        log(f"  {name:28s} {pl}")
    log(f"  (blocks.1.. like blocks.0)")

    batches = make_batches(cfg)
    dbatches = [(vescale.distribute_tensor(i, mesh, [Shard(0), Replicate()]),
                 vescale.distribute_tensor(t, mesh, [Shard(0), Replicate()])) for i, t in batches]

    log(f"vescale: {STEPS} AdamW steps, batch {BATCH} x seq {cfg.seq_len} split over DP")
    losses = train(model, dbatches, log)

    # The single-process reference: same seed, same data, whole batch, plain tensors.
    torch.manual_seed(0)
    ref_model = TinyTransformer(cfg)
    log("reference (plain PyTorch, one process):")
    ref_losses = train(ref_model, batches, log)

    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    # Parameters too (information only). attn.k.bias is left out: softmax is invariant to
    # it, so its gradient is zero up to rounding and AdamW turns that noise into lr-size steps.
    with torch.no_grad():
        ref_params = dict(ref_model.named_parameters())
        pdiff = max((p.full_tensor() - ref_params[n]).abs().max().item()
                    for n, p in model.named_parameters() if not n.endswith("attn.k.bias"))
    ok = rel <= RTOL
    log(f"max |param - reference| after {STEPS} steps (attn.k.bias aside): {pdiff:.3e}")
    log(f"{'PASS' if ok else 'FAIL'}: max relative loss difference {rel:.3e} "
        f"(tolerance {RTOL:.0e}, float32)")
    log(f"fallback ops (no sharding rule, ran replicated): {vescale.fallback_counts() or 'none'}")

    dist.barrier()  # let every rank finish its collectives before the groups go away
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
