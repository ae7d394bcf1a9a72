#!/usr/bin/env python
"""Creating and sharding a GPT too big to build casually: time and peak memory per rank
on 4 CPU ranks (TP4), three ways, each in fresh processes.

    .venv/bin/python bench/deferred_init.py [--layers 36]

    deferred    vescale.deferred_init(GPT, cfg) + parallelize_module(gpt_plan) + materialize_module
                (values bitwise those of a single-device GPT(cfg) with the same seed)
    full        GPT(cfg) on every rank, then parallelize_module (distribute_tensor slices it)
    torch meta  torchtitan's pattern: GPT(cfg) under torch.device("meta"), torch's TP plan,
                to_empty(), then the model's init run on the sharded DTensors (per-rank
                random values: not those of a single device)

The default GPT is GPT-2 large's shape (36 layers, 1280 wide, 20 heads, vocabulary 50304,
context 1024): 774M parameters, 3.1 GB in fp32. Time: the slowest rank's wall time from
nothing to a sharded model. Peak: the largest rise of a rank's peak resident memory
(VmHWM) over that time.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import math
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import free_port  # noqa: E402

WORLD = 4


def config(layers: int):
    from examples.models.gpt import GPTConfig
    return GPTConfig(block_size=1024, vocab_size=50304, n_layer=layers, n_head=20, n_embd=1280, dropout=0.0,
                     bias=False)


def peak_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def torch_init_weights(model, cfg) -> None:
    """GPT's own init (its _init_weights and the scaled c_proj), run on the shards."""
    with torch.no_grad():
        model.apply(model._init_weights)
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))


def build(way: str, cfg, vmesh):
    from examples.models.gpt import GPT
    import vescale
    from vescale.parallel import parallelize_module
    from vescale.parallel.plans import gpt_plan

    torch.manual_seed(0)
    if way == "deferred":
        model = vescale.deferred_init(GPT, cfg)
        parallelize_module(model, vmesh, gpt_plan())
        return vescale.materialize_module(model)
    if way == "full":
        model = GPT(cfg)
        return parallelize_module(model, vmesh, gpt_plan())
    from bench.common import torch_gpt_tp

    with torch.device("meta"):
        model = GPT(cfg)
    torch_gpt_tp(model, vmesh.to_torch())
    model.to_empty(device="cpu")
    torch_init_weights(model, cfg)
    return model


def _rank(rank: int, port: int, way: str, layers: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    import vescale

    vmesh = vescale.DeviceMesh("cpu", list(range(WORLD)))
    cfg = config(layers)
    from examples.models.gpt import GPT  # noqa: F401  (imports before the clock)
    with torch.device("meta"):
        GPT(config(1))
    vescale.deferred_init(GPT, config(1))  # the first dispatch mode loads library code: not counted
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = peak_kb()
    dist.barrier()
    t0 = time.perf_counter()
    model = build(way, cfg, vmesh)
    dist.barrier()
    took = time.perf_counter() - t0
    rise = (peak_kb() - base) / 1024
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters()) / 2**20
    first = next(p for n, p in model.named_parameters() if n.endswith("h.0.mlp.c_fc.weight"))
    sample = (first.to_local() if hasattr(first, "to_local") else first)[:2, :4].clone()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, dict(seconds=took, peak_mb=rise, local_mb=local, sample=sample))
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--ways", default="deferred,full,torch meta")
    args = ap.parse_args()
    cfg = config(args.layers)
    params = (cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd
              + cfg.n_layer * (12 * cfg.n_embd**2 + 2 * cfg.n_embd) + cfg.n_embd)
    print(f"GPT: {cfg.n_layer} layers, width {cfg.n_embd}, vocabulary {cfg.vocab_size}: {params / 1e6:.0f}M "
          f"parameters, {params * 4 / 1e9:.2f} GB fp32; TP4 on {WORLD} gloo ranks; torch {torch.__version__}\n")
    print("%-11s %10s %14s %14s  %s" % ("way", "seconds", "peak MB/rank", "shard MB/rank", "c_fc[0] sample"))
    samples = {}
    for way in args.ways.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.pt")
            mp.spawn(_rank, args=(free_port(), way, args.layers, out), nprocs=WORLD, join=True)
            ranks = torch.load(out)
        samples[way] = ranks[0]["sample"]
        print("%-11s %10.1f %14.0f %14.0f  %s" % (way, max(r["seconds"] for r in ranks),
                                                   max(r["peak_mb"] for r in ranks), max(r["local_mb"] for r in ranks),
                                                   [round(v, 5) for v in ranks[0]["sample"][0].tolist()]))
    if "deferred" in samples and "full" in samples:
        print(f"\ndeferred shard values == full-init shard values (rank 0 sample): "
              f"{torch.equal(samples['deferred'], samples['full'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
