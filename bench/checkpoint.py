#!/usr/bin/env python
"""Checkpoint throughput on 4 CPU ranks: vescale.save / vescale.load against
torch.distributed.checkpoint (DCP) on torch's own DTensor with the same sharding.

    .venv/bin/python bench/checkpoint.py [--gb 1.0] [--repeat 3] [--dir /tmp]

The state is ``--gb`` of fp32 weights: square matrices on a DP2xTP2 mesh, split over
TP rows and replicated over DP (so each stack writes every byte once). Timed, per
stack, as medians of ``--repeat`` runs with a barrier before and after:

    save        DP2xTP2 -> files (both stacks fsync their files)
    load        files -> the same DP2xTP2 sharding
    reshard     files -> a 1-d TP4 mesh split over columns (every rank reads strided parts)

GB/s is the checkpoint's size (bytes of the global tensors) over the slowest rank's
time. Files land in the page cache right after being written, so loads mostly read
memory; both stacks alike. A benchmark, never a test.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.tensor import Replicate as TR, Shard as TS, distribute_tensor as torch_distribute

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vescale  # noqa: E402
from vescale import Replicate, Shard  # noqa: E402

WORLD, SIDE = 4, 4096  # 64 MiB per fp32 matrix


def tensors(gb: float) -> list[torch.Tensor]:
    count = max(1, round(gb * 2**30 / (SIDE * SIDE * 4)))
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SIDE, SIDE, generator=g) for _ in range(count)]


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _rank_main(rank: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    v2 = vescale.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("DP", "TP"))
    v1 = vescale.DeviceMesh("cpu", list(range(WORLD)))
    t2, t1 = v2.to_torch(), v1.to_torch()
    fulls = tensors(args.gb)
    size_gb = sum(t.numel() * 4 for t in fulls) / 1e9
    src = [Replicate(), Shard(0)]
    stacks = {
        "vescale": dict(
            make=lambda mesh, pl: {f"w{i}": vescale.distribute_tensor(t, mesh, pl) for i, t in enumerate(fulls)},
            meshes=(v2, v1), src=src, dst=[Shard(1)],
            save=lambda state, path: vescale.save(path, state),
            load=lambda state, path: vescale.load(path, state, rng=False)),
        "torch DCP": dict(
            make=lambda mesh, pl: {f"w{i}": torch_distribute(t, mesh, pl) for i, t in enumerate(fulls)},
            meshes=(t2, t1), src=[TR(), TS(0)], dst=[TS(1)],
            save=lambda state, path: dcp.save(state, checkpoint_id=path),
            load=lambda state, path: dcp.load(state, checkpoint_id=path)),
    }
    base = os.path.join(args.dir, "vescale-ckpt-bench")
    results = {}
    for name, s in stacks.items():
        state = s["make"](s["meshes"][0], s["src"])
        target = s["make"](s["meshes"][0], s["src"])
        resharded = s["make"](s["meshes"][1], s["dst"])
        times = {"save": [], "load": [], "reshard": []}
        for r in range(args.repeat):
            path = f"{base}-{name.split()[-1].lower()}-{r}"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            times["save"].append(timed(lambda: s["save"](state, path)))
            times["load"].append(timed(lambda: s["load"](target, path)))
            times["reshard"].append(timed(lambda: s["load"](resharded, path)))
        ok = all(torch.equal(_full(target[k]), fulls[int(k[1:])]) and torch.equal(_full(resharded[k]), fulls[int(k[1:])])
                 for k in state)
        results[name] = dict(times=times, correct=ok)
        dist.barrier()
        if rank == 0:
            for r in range(args.repeat):
                shutil.rmtree(f"{base}-{name.split()[-1].lower()}-{r}", ignore_errors=True)
        del state, target, resharded
    if rank == 0:
        torch.save(dict(results=results, size_gb=size_gb), out_path)
    dist.barrier()
    dist.destroy_process_group()


def _full(t):
    return t.full_tensor()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_rank_main, args=(free_port(), args, out), nprocs=WORLD, join=True)
        result = torch.load(out)
    size = result["size_gb"]
    print(f"checkpoint of {size:.2f} GB (fp32 {SIDE}x{SIDE} matrices), {WORLD} gloo ranks, DP2xTP2 [R, S(0)]; "
          f"reshard into TP4 [S(1)]; torch {torch.__version__}; medians of {args.repeat}; dir {args.dir}\n")
    print("%-10s %14s %14s %14s  %s" % ("stack", "save GB/s", "load GB/s", "reshard GB/s", "loaded values equal"))
    for name, r in result["results"].items():
        cells = [f"{size / statistics.median(r['times'][k]):.2f} ({statistics.median(r['times'][k]):.2f}s)"
                 for k in ("save", "load", "reshard")]
        print("%-10s %14s %14s %14s  %s" % (name, *cells, r["correct"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
