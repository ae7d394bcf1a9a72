#!/usr/bin/env python
"""The host's share of a training step: a GPT so small (12 layers x 16 wide, sequence 16,
batch 1) that every kernel is trivial and the step is the host's dispatch work, plain torch
against vescale on a 1-rank mesh (gpt_plan on "TP", DDP on "DP", as bench/gpu_step.py).
Run on the CPU and on a GPU, it tells whether vescale's extra host time depends on the
device or only on the host, and how fast that host is.

    python bench/host_step.py [--device cpu|cuda] [--precision fp32|bf16] [--steps 200] [--rounds 2]

The ways take turns, --rounds times each (a fresh process per way and round would be
cleaner but is not needed: the ways share nothing but the process). Prints the median
step time and the host time of forward, backward and optimizer step. A benchmark, never
a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.models from a checkout

import vescale  # noqa: E402
from vescale.parallel import DDP, parallelize_module  # noqa: E402
from vescale.parallel.plans import gpt_plan  # noqa: E402
from examples.models.gpt import GPT, GPTConfig  # noqa: E402
from bench.common import free_port  # noqa: E402

CFG = GPTConfig(block_size=16, vocab_size=64, n_layer=12, n_head=2, n_embd=16, bias=False)


def build(way: str, mesh, device: str):
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    if way == "vescale":
        parallelize_module(model, mesh["TP"], gpt_plan())
        model = DDP(model, mesh["DP"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def run(model, opt, batch, device: str, precision: str, steps: int) -> tuple[float, list[float]]:
    """Median ms per step over ``steps`` (the device synchronised at both ends) and the
    median host ms of forward, backward and optimizer step."""
    idx, tgt = batch
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    phases: list[list[float]] = [[], [], []]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        a = time.perf_counter()
        with autocast():
            loss = model(idx, tgt)
        b = time.perf_counter()
        loss.backward()
        c = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        d = time.perf_counter()
        for i, dt in enumerate((b - a, c - b, d - c)):
            phases[i].append(dt * 1e3)
    sync()
    return (time.perf_counter() - t0) / steps * 1e3, [statistics.median(p) for p in phases]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here")
        return 1
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    mesh = vescale.init_device_mesh(args.device, (1, 1), mesh_dim_names=("DP", "TP"))
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, CFG.vocab_size, (1, CFG.block_size), generator=g).to(args.device) for _ in range(2))
    ways = {name: build(name, mesh, args.device) for name in ("torch", "vescale")}
    for model, opt in ways.values():
        run(model, opt, batch, args.device, args.precision, 20)  # warm-up
    results: dict[str, list] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, (model, opt) in ways.items():
            results[name].append(run(model, opt, batch, args.device, args.precision, args.steps))
    print(f"{args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'host CPU'}), "
          f"{args.precision}, {args.steps} steps x {args.rounds} rounds")
    print(f"{'way':8} {'ms/step':>8} {'forward':>8} {'backward':>9} {'optimizer':>10}   (host ms, medians)")
    for name, rows in results.items():
        for step_ms, (fwd, bwd, opt_ms) in rows:
            print(f"{name:8} {step_ms:8.3f} {fwd:8.3f} {bwd:9.3f} {opt_ms:10.3f}")
    ratio = statistics.median(r[0] for r in results["vescale"]) / statistics.median(r[0] for r in results["torch"])
    print(f"vescale / torch step time: {ratio:.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
