#!/usr/bin/env python
"""Training-step throughput of a GPT on one GPU: plain torch against vescale on a 1-rank
mesh, where every parameter is a DTensor and every op goes through vescale's dispatcher.
torch's own DTensor stack on the same 1-rank mesh runs beside them for reference.

    python bench/gpu_step.py [--sizes small,gpt2] [--precisions fp32,bf16] [--steps 40] [--json PATH] [--profile]

Ways, each from the same seed-0 model and the same batches:

    torch          GPT(cfg).cuda(), AdamW
    torch again    the same once more: the noise floor of the step time and of the losses
    vescale        parallelize_module(gpt_plan) on the mesh's 1-rank "TP" dim, DDP on its
                   1-rank "DP" dim, AdamW (the whole stack a DP x TP plan uses)
    torch DTensor  torch's parallelize_module with the same plan on a 1-rank mesh
                   (bench/common.torch_gpt_tp) and loss_parallel; AdamW without foreach

A step is forward, backward, AdamW step and zero_grad, timed from a torch.cuda.synchronize()
to the next (``host ms``: until the host had issued the step; where it is close to the
step's time, the GPU waited for the host). Each way is warmed up and its peak CUDA memory read alone (above what the ways
built before it hold); then the ways take turns step by step. The report shows median step
times, tokens per second and their ratio to plain torch (the target: vescale >= 0.98 of
plain torch on the GPT-2-sized step), and the relative difference from plain torch's losses
at the first step (same weights) and at worst over the run (the GPU's nondeterministic
kernels make runs drift apart, plain torch's own included).

Sizes: ``small`` (4 layers x 256, sequence 256, batch 8: the GPU waits for the host, so
per-op overhead shows) and ``gpt2`` (GPT-2 small: 12 layers x 768, vocabulary 50304,
sequence 1024, batch 8). Precisions: fp32 with TF32 matmuls, and bf16 autocast.
A benchmark, never a test: problems are listed, not raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.models from a checkout

import vescale  # noqa: E402
from vescale.parallel import DDP, parallelize_module  # noqa: E402
from vescale.parallel.plans import gpt_plan  # noqa: E402
from examples.models.gpt import GPT, GPTConfig  # noqa: E402
from bench.common import free_port, torch_gpt_tp  # noqa: E402

SIZES = {
    "small": (GPTConfig(block_size=256, vocab_size=8192, n_layer=4, n_head=4, n_embd=256, bias=False), 8, 256),
    "gpt2": (GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=False), 8, 1024),
}
WAYS = ("torch", "vescale", "torch DTensor", "torch again")
LR = 3e-4
DEVICE = "cuda"
PROFILE = False


class Way:
    def __init__(self, name: str, model, opt, loss_ctx=contextlib.nullcontext):
        self.name, self.model, self.opt, self.loss_ctx = name, model, opt, loss_ctx
        self.times: list[float] = []
        self.host: list[float] = []  # until the host had issued the whole step
        self.phases: list[list[float]] = []  # host seconds of forward, backward, optimizer step, zero_grad
        self.losses: list[torch.Tensor] = []


def build(name: str, cfg: GPTConfig, mesh) -> Way:
    torch.manual_seed(0)
    model = GPT(cfg).to(DEVICE)
    if name == "vescale":
        parallelize_module(model, mesh["TP"], gpt_plan())
        model = DDP(model, mesh["DP"])
    elif name == "torch DTensor":
        torch_gpt_tp(model, mesh.to_torch()["TP"])
        # foreach=False: torch's foreach kernels refuse its mix of DTensor (planned) and plain
        # (LayerNorm, position embedding) parameters
        return Way(name, model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=False), loss_parallel)
    return Way(name, model, torch.optim.AdamW(model.parameters(), lr=LR))


PHASES = ("forward", "backward", "optimizer", "zero_grad")


def step(w: Way, batch, precision: str, stamps: list | None = None) -> None:
    """One training step; ``stamps`` gets the host clock after each of PHASES."""
    mark = (lambda: stamps.append(time.perf_counter())) if stamps is not None else (lambda: None)
    idx, tgt = batch
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with w.loss_ctx():
        with autocast:  # autocast runs the model's cross_entropy in fp32
            loss = w.model(idx, tgt)
        mark()
        loss.backward()
        mark()
    w.opt.step()
    mark()
    w.opt.zero_grad(set_to_none=True)
    mark()
    w.losses.append(loss.detach())


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(w: Way, batch, precision: str) -> None:
    sync()
    t0 = time.perf_counter()
    stamps = [t0]
    step(w, batch, precision, stamps)
    w.host.append(time.perf_counter() - t0)
    w.phases.append([b - a for a, b in zip(stamps, stamps[1:])])
    sync()
    w.times.append(time.perf_counter() - t0)


def print_profile(title: str, w: Way, batch, precision: str) -> None:
    """One step under torch's profiler: the ops that took most GPU time, and how many aten
    ops the host dispatched (a DTensor op counts once for itself and once per local op)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(w, batch, precision)
        sync()
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = sum(e.count for e in events if "Synchronize" in e.key or "DtoH" in e.key)
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"--- {title}: {aten} aten op calls on the host, {syncs} host waits (synchronize, "
          f"device-to-host copy), {gpu_ms:.1f} ms of GPU time; top GPU time:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5d} {e.key[:90]}")
    cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    print(f"    and top host time ({cpu_ms:.1f} ms in all, under the profiler):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count:<5d} {e.key[:90]}")


def loss_value(v) -> float:
    return (v.full_tensor() if isinstance(v, (TorchDTensor, vescale.DTensor)) else v).item()


def run(size: str, precision: str, mesh, steps: int, problems: list) -> dict:
    cfg, batch, seq = SIZES[size]
    g = torch.Generator().manual_seed(7)
    data = []
    for _ in range(4):
        d = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(DEVICE)
        data.append((d[:, :-1].contiguous(), d[:, 1:].contiguous()))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    vescale.reset_fallback_counts()
    ways, peak = {}, {}
    for name in WAYS:
        try:
            before = 0  # the ways built before this one stay alive (they take turns below)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            w = build(name, cfg, mesh)
            for i in range(3):
                step(w, data[i % 4], precision)
            sync()
            peak[name] = (torch.cuda.max_memory_allocated() - before) / 2**20 if DEVICE == "cuda" else 0
            ways[name] = w
        except Exception as e:  # record, never hide: the row shows the way as missing
            problems.append(f"{size}/{precision}: {name} failed: {type(e).__name__}: {e}".splitlines()[0])
    for i in range(steps):  # take turns, alternating who goes first
        for name in (WAYS if i % 2 == 0 else WAYS[::-1]):
            if name in ways:
                timed(ways[name], data[(3 + i) % 4], precision)
    if PROFILE:
        for name, w in ways.items():
            print_profile(f"{size}/{precision}/{name}", w, data[0], precision)
    if vescale.fallback_counts():
        problems.append(f"{size}/{precision}: vescale used the replicate fallback for {vescale.fallback_counts()}")
    row = dict(size=size, precision=precision, batch=batch, seq=seq, ways={})
    base = statistics.median(ways["torch"].times) if "torch" in ways else None
    ref_losses = [loss_value(v) for v in ways["torch"].losses] if "torch" in ways else None
    for name, w in ways.items():
        ms = statistics.median(w.times) * 1e3
        q = statistics.quantiles(w.times, n=4)
        losses = [loss_value(v) for v in w.losses]
        row["ways"][name] = dict(
            median_ms=round(ms, 2), iqr_ms=[round(q[0] * 1e3, 2), round(q[2] * 1e3, 2)],
            host_ms=round(statistics.median(w.host) * 1e3, 2),
            host_ms_by_phase={ph: round(statistics.median(p[i] for p in w.phases) * 1e3, 2)
                              for i, ph in enumerate(PHASES)},
            tokens_per_s=round(batch * seq / (ms / 1e3)), peak_mb=round(peak[name]),
            throughput_vs_torch=None if base is None else round(base * 1e3 / ms, 4),
            # the first step starts from the same weights; later ones drift apart as the GPU's
            # nondeterministic kernels (atomic adds in attention's backward) feed the optimizer
            first_loss_rel_diff=None if ref_losses is None else abs(losses[0] - ref_losses[0]) / abs(ref_losses[0]),
            max_loss_rel_diff=None if ref_losses is None else
            max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)))
    return row


def print_rows(rows: list, problems: list) -> None:
    print(f"\n{'size':6} {'prec':5} {'way':14} {'median ms':>10} {'IQR ms':>16} {'host ms':>8} {'tokens/s':>10} "
          f"{'vs torch':>9} {'peak MiB':>9} {'loss 1 diff':>11} {'max diff':>9}")
    for r in rows:
        for name, w in r["ways"].items():
            iqr = f"{w['iqr_ms'][0]:.2f}-{w['iqr_ms'][1]:.2f}"
            ratio, first, diff = w["throughput_vs_torch"], w["first_loss_rel_diff"], w["max_loss_rel_diff"]
            print(f"{r['size']:6} {r['precision']:5} {name:14} {w['median_ms']:10.2f} {iqr:>16} {w['host_ms']:8.2f} "
                  f"{w['tokens_per_s']:10d} "
                  f"{'-' if ratio is None else f'{ratio:.3f}':>9} {w['peak_mb']:9d} "
                  f"{'-' if first is None else f'{first:.1e}':>11} {'-' if diff is None else f'{diff:.1e}':>9}")
    print(f"\nhost ms by phase (medians; the GPU runs behind): {', '.join(PHASES)}")
    for r in rows:
        for name, w in r["ways"].items():
            print(f"{r['size']:6} {r['precision']:5} {name:14} " +
                  " ".join(f"{w['host_ms_by_phase'][ph]:9.2f}" for ph in PHASES))
    for p in problems:
        print("PROBLEM:", p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,gpt2")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="print each way's top GPU ops for one step")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (gloo), for development")
    args = ap.parse_args()
    global DEVICE, PROFILE
    DEVICE, PROFILE = args.device, args.profile
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA device; this machine has none")
        return 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    mesh = vescale.init_device_mesh(DEVICE, (1, 1), mesh_dim_names=("DP", "TP"))
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, vescale dispatching on {mesh}")
    rows, problems = [], []
    for size in args.sizes.split(","):
        for precision in args.precisions.split(","):
            rows.append(run(size, precision, mesh, args.steps, problems))
            print(json.dumps(rows[-1]), flush=True)
    print_rows(rows, problems)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, problems=problems, device=name,
                           torch=torch.__version__), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
