#!/usr/bin/env python
"""Checkpoint throughput on 4 CPU ranks: vescale.save / vescale.load against
torch.distributed.checkpoint (DCP) on torch's own DTensor with the same sharding.

    .venv/bin/python bench/checkpoint.py [--layers 16] [--repeat 3] [--dir /tmp]

The model is a GPT (vocabulary 50304, width 1024, 16 layers: 254M parameters, 1.02 GB fp32)
under Megatron tensor parallelism on the TP dim of a DP2xTP2 mesh (vescale: gpt_plan; torch:
the same plan with ColwiseParallel/RowwiseParallel), replicated over DP, so each stack writes
every byte once. Timed, per stack, as medians of ``--repeat`` runs with a barrier before and
after:

    save        the DP2xTP2 model -> files (both stacks fsync their files)
    load        files -> a second model, same sharding (other initial values)
    reshard     files -> a model on a 1-d TP4 mesh (4-way shards of every split weight)

GB/s is the model's size (its parameters, the tied embedding once) over the slowest rank's
time. Files land in the page cache right after being written, so loads mostly read memory;
both stacks alike. The loaded models are checked equal to the saved one. A benchmark, never a
test.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vescale  # noqa: E402
from bench.common import free_port, torch_gpt_tp  # noqa: E402

WORLD = 4


def config(layers: int):
    from examples.models.gpt import GPTConfig
    return GPTConfig(block_size=1024, vocab_size=50304, n_layer=layers, n_head=16, n_embd=1024, dropout=0.0,
                     bias=False)


def vescale_model(cfg, seed: int, tp_mesh):
    """Built shard by shard (vescale.deferred_init): four ranks holding three models each
    would not fit in memory if every model were first built whole."""
    from examples.models.gpt import GPT
    from vescale.parallel import parallelize_module
    from vescale.parallel.plans import gpt_plan

    torch.manual_seed(seed)
    return {"model": parallelize_module(vescale.deferred_init(GPT, cfg), tp_mesh, gpt_plan())}


def torch_model(cfg, seed: int, tp_mesh):
    """gpt_plan in torch's terms; the state DCP sees, without the tied output projection's
    second name (vescale writes a tied tensor once too). Only the saved model (seed 0) gets
    real values; load targets are built on the meta device and given storage (to_empty)."""
    from examples.models.gpt import GPT

    torch.manual_seed(seed)
    with torch.device("meta" if seed else "cpu"):
        model = GPT(cfg)
    torch_gpt_tp(model, tp_mesh)
    if seed:
        model.to_empty(device="cpu")
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def tensors(state) -> dict:
    if "model" in state:
        return {k: v for k, v in state["model"].state_dict().items() if k != "lm_head.weight"}
    return state


def same_values(a, b) -> bool:
    """Whether two states hold equal global tensors (gathered one at a time)."""
    ta, tb = tensors(a), tensors(b)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return ta.keys() == tb.keys() and all(torch.equal(full(ta[k]), full(tb[k])) for k in ta)


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
    cfg = config(args.layers)
    stacks = {
        "vescale": dict(make=vescale_model, meshes=(v2["TP"], v1),
                        save=lambda state, path: vescale.save(path, state),
                        load=lambda state, path: vescale.load(path, state, rng=False)),
        "torch DCP": dict(make=torch_model, meshes=(t2["TP"], t1),
                          save=lambda state, path: dcp.save(state, checkpoint_id=path),
                          load=lambda state, path: dcp.load(state, checkpoint_id=path)),
    }
    base = os.path.join(args.dir, "vescale-ckpt-bench")
    models = {name: [s["make"](cfg, seed, s["meshes"][0 if seed < 2 else 1]) for seed in range(3)]
              for name, s in stacks.items()}
    size_gb = sum(math.prod(t.shape) * t.element_size() for t in tensors(models["vescale"][0]).values()) / 1e9
    times = {name: {"save": [], "load": [], "reshard": []} for name in stacks}
    for r in range(args.repeat):  # the stacks take turns, and alternate who goes first
        for name in (list(stacks) if r % 2 == 0 else list(stacks)[::-1]):
            s, (state, target, resharded) = stacks[name], models[name]
            path = f"{base}-{r}"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            times[name]["save"].append(timed(lambda: s["save"](state, path)))
            times[name]["load"].append(timed(lambda: s["load"](target, path)))
            times[name]["reshard"].append(timed(lambda: s["load"](resharded, path)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    results = {name: dict(times=times[name], correct=same_values(m[0], m[1]) and same_values(m[0], m[2]))
               for name, m in models.items()}
    if rank == 0:
        torch.save(dict(results=results, size_gb=size_gb), out_path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="GPT layers (default 16: 1.02 GB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_rank_main, args=(free_port(), args, out), nprocs=WORLD, join=True)
        result = torch.load(out)
    size = result["size_gb"]
    print(f"GPT of {size:.2f} GB ({args.layers} layers, width 1024, vocabulary 50304), Megatron TP on a "
          f"DP2xTP2 mesh, {WORLD} gloo ranks; reshard into TP4; torch {torch.__version__}; medians of "
          f"{args.repeat}; dir {args.dir}\n")
    print("%-10s %14s %14s %14s  %s" % ("stack", "save GB/s", "load GB/s", "reshard GB/s", "loaded values equal"))
    for name, r in result["results"].items():
        cells = [f"{size / statistics.median(r['times'][k]):.2f} ({statistics.median(r['times'][k]):.2f}s)"
                 for k in ("save", "load", "reshard")]
        print("%-10s %14s %14s %14s  %s" % (name, *cells, r["correct"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
