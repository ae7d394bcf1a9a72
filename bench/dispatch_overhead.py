#!/usr/bin/env python
"""Per-op dispatch overhead: plain torch vs vescale DTensor vs torch's own DTensor.

Small tensors (64x64 float32) make the op itself cheap, so what is left is the cost of
getting to it. All three stacks run in the same process on the same ranks and take turns
block by block, so that load on the shared machine slows them alike; each number is the
median per-call time over many blocks. "Overhead" is a stack's time minus plain torch's
on the same local tensors (the shard, for Shard(0)): what the DTensor layer adds.

    .venv/bin/python bench/dispatch_overhead.py [--quick] [--json PATH]

The 1-rank mesh runs in this process; the 2-rank mesh runs in two spawned processes
(gloo), of which rank 0 reports. A benchmark, never a test: errors, fallbacks and wrong
results are listed in the output, not raised.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: one thread per rank on 2 cores

import argparse
import faulthandler
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard
from torch.distributed.tensor import distribute_tensor as torch_distribute
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.common from a checkout

import vescale  # noqa: E402
from bench.common import free_port  # noqa: E402

SIZE = 64            # tensors are SIZE x SIZE float32
N_PARAMS = 50        # parameters in the AdamW step
TARGET_US = 3.0      # vescale may add at most this much per op over plain torch...
TARGET_RATIO = 0.2   # ...and at most this fraction of what torch's DTensor adds
STACKS = ("plain", "vescale", "torch")

# name -> (fn(x, y, w), needs no communication under Shard(0)).
# x and y have the layout under test; w (the right mm operand) is always replicated.
OPS = {
    "add": (lambda x, y, w: x + y, True),
    "mul": (lambda x, y, w: x * y, True),
    "mm": (lambda x, y, w: x @ w, True),
    "view": (lambda x, y, w: x.view(-1, 8, 8), True),
    "sum": (lambda x, y, w: x.sum(), False),  # under Shard(0) the result would be Partial
    "softmax": (lambda x, y, w: torch.softmax(x, -1), True),
    "layer_norm": (lambda x, y, w: F.layer_norm(x, (SIZE,)), True),
    "detach": (lambda x, y, w: x.detach(), True),
}


def settings(args) -> dict:
    # rounds x blocks timed blocks of about block_us per stack and op, after untimed warm-up
    # calls (caches, allocator); a rank still running after watchdog_s dumps its stack and exits.
    cfg = (dict(rounds=2, blocks=4, block_us=300, warmup=100, adamw_blocks=3, adamw_warmup=2, watchdog_s=120)
           if args.quick else
           dict(rounds=6, blocks=10, block_us=1000, warmup=1000, adamw_blocks=10, adamw_warmup=5, watchdog_s=600))
    return cfg


def makers(vmesh) -> dict:
    """stack -> fn(full tensor, layout) giving that stack's version of it on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tmesh = vmesh.to_torch()  # torch's DTensor runs on the very same process groups
    vp = {"R": [vescale.Replicate()], "S0": [vescale.Shard(0)]}
    tp = {"R": [TReplicate()], "S0": [TShard(0)]}
    return {
        "plain": lambda full, lay: full.chunk(world, 0)[rank].clone() if lay == "S0" else full.clone(),
        "vescale": lambda full, lay: vescale.distribute_tensor(full, vmesh, vp[lay]),
        "torch": lambda full, lay: torch_distribute(full, tmesh, tp[lay]),
    }


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # hasattr is False on plain tensors


# ---- timing ------------------------------------------------------------------------------

@dataclass
class Case:
    """One table row: a callable per stack, timed later together with all the other cases."""
    op: str
    layout: str
    fns: dict
    calls: dict                     # stack -> calls per timed block
    blocks: int                     # blocks per round
    ops_per_call: int = 1           # aten ops one call dispatches (an AdamW step: many)
    after: Callable | None = None   # a check to run once the timing is over
    samples: dict = field(default_factory=lambda: defaultdict(list))


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def calls_per_block(fns: dict, block_us: float) -> dict:
    """Calls that make each stack's block last about block_us: a preemption is then as likely
    to spoil a block of the fast stack as one of the slow. The fastest of a few short runs
    estimates a call's cost despite the noise."""
    return {s: max(1, round(block_us / min(per_call_us(fn, 10) for _ in range(5)))) for s, fn in fns.items()}


def measure(cases: list, rounds: int) -> None:
    """Times every case in `rounds` rounds spread over the whole run and pools the samples:
    a burst of load then spoils a few blocks of many cases rather than all blocks of one."""
    for _ in range(rounds):
        for case in cases:
            gc.collect()
            dist.barrier()  # both ranks time the same case together (same CPU contention)
            for _ in range(case.blocks):
                for stack, fn in case.fns.items():
                    case.samples[stack].append(per_call_us(fn, case.calls[stack]))


# ---- preparing the cases, with the checks that find problems in vescale ---------------------

def warm(fns: dict, n: int, problems: list, what: str) -> dict:
    """Runs each fn n times; a stack whose fn raises is dropped and its error recorded."""
    ok = {}
    for stack, fn in fns.items():
        try:
            for _ in range(n):
                fn()
            ok[stack] = fn
        except Exception as e:  # record, never hide: the table shows the stack as missing
            problems.append(f"{what}: {stack} raised {type(e).__name__}: {e}".splitlines()[0])
    check_fallbacks(problems, what)
    return ok


def check_fallbacks(problems: list, what: str) -> None:
    counts = vescale.fallback_counts()
    if counts:
        problems.append(f"{what}: vescale used the replicate fallback for {counts}")
    vescale.reset_fallback_counts()


def check_placements(ves, tor, problems: list, what: str) -> None:
    """vescale's placements against torch's, except on mesh dims of one rank: vescale calls
    every placement there Replicate (the same data; docs/engine.md), torch keeps the Shard."""
    if ves is None or tor is None:
        return
    sizes = ves.device_mesh.shape
    torch_placements = tuple(vescale.Replicate() if n == 1 else p for p, n in zip(tor.placements, sizes))
    if str(tuple(ves.placements)) != str(torch_placements):
        problems.append(f"{what}: vescale gives placements {tuple(ves.placements)}, "
                        f"torch's DTensor {tuple(tor.placements)}")


def prepare_op(name, fn, layout, make, cfg, problems) -> Case:
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(SIZE, SIZE, generator=g) for k in "xyw"}
    what = f"{name} {layout} on {dist.get_world_size()} rank(s)"
    fns = {}
    for stack in STACKS:
        x, y, w = make[stack](full["x"], layout), make[stack](full["y"], layout), make[stack](full["w"], "R")
        fns[stack] = (lambda x=x, y=y, w=w: fn(x, y, w))
    fns = warm(fns, cfg["warmup"], problems, what)
    outs = {stack: f() for stack, f in fns.items()}
    for stack in ("vescale", "torch"):  # same math on the same local data: the results must agree
        if stack in outs and not torch.allclose(local(outs[stack]), outs["plain"], atol=1e-5):
            problems.append(f"{what}: {stack} result differs from plain torch on the local shard")
    check_placements(outs.get("vescale"), outs.get("torch"), problems, what)
    return Case(name, layout, fns, calls_per_block(fns, cfg["block_us"]), cfg["blocks"])


def make_adamw(make_one, layout: str):
    g = torch.Generator().manual_seed(1)
    params = []
    for _ in range(N_PARAMS):
        p = torch.nn.Parameter(make_one(torch.randn(SIZE, SIZE, generator=g), layout))
        p.grad = make_one(torch.randn(SIZE, SIZE, generator=g), layout)
        params.append(p)
    return params, torch.optim.AdamW(params, lr=1e-3, foreach=False)


class _TensorOpCounter(TorchDispatchMode):
    """Counts aten ops with a non-scalar tensor argument: those a DTensor stack dispatches
    (AdamW's scalar `step` counter stays a plain tensor)."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.n += any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in tree_leaves((args, kwargs)))
        return func(*args, **kwargs)


def prepare_adamw(layout, make, cfg, problems) -> Case:
    what = f"adamw {layout} on {dist.get_world_size()} rank(s)"
    built = {stack: make_adamw(make[stack], layout) for stack in STACKS}
    check_placements(built["vescale"][0][0], built["torch"][0][0], problems, f"{what}: nn.Parameter")
    fns = warm({s: opt.step for s, (_, opt) in built.items()}, cfg["adamw_warmup"], problems, what)

    def after():  # every surviving stack has taken the same number of steps from the same start
        for stack in ("vescale", "torch"):
            if stack in fns and not all(torch.allclose(local(p), q, atol=1e-5)
                                        for p, q in zip(built[stack][0], built["plain"][0])):
                problems.append(f"{what}: {stack} parameters differ from plain torch after the same steps")

    _, opt = make_adamw(make["plain"], layout)  # count the ops of a steady-state step (not the first)
    opt.step()
    with _TensorOpCounter() as counter:
        opt.step()
    return Case(f"adamw({N_PARAMS})", layout, fns, {s: 1 for s in fns}, cfg["adamw_blocks"], counter.n, after)


# ---- running and reporting ------------------------------------------------------------------

def row(case: Case, ranks: int) -> dict:
    """A table row; a case of many ops (an AdamW step) spreads its overhead over them."""
    r = dict(op=case.op, layout=case.layout, ranks=ranks, ops_per_call=case.ops_per_call,
             calls_per_block=case.calls)
    for s in STACKS:
        v = case.samples.get(s)
        r[f"{s}_us"] = statistics.median(v) if v else None
        r[f"{s}_quartiles_us"] = statistics.quantiles(v, n=4) if v else None  # the spread, for the JSON
    p, v, t = r["plain_us"], r["vescale_us"], r["torch_us"]
    vo = r["vescale_overhead_us"] = None if v is None else v - p
    to = r["torch_overhead_us"] = None if t is None else t - p
    r["overhead_ratio"] = vo / to if vo is not None and to and to > 0 else None
    r["vescale_overhead_per_op_us"] = None if vo is None else vo / case.ops_per_call
    r["meets_3us"] = None if vo is None else r["vescale_overhead_per_op_us"] <= TARGET_US
    r["meets_fifth"] = None if r["overhead_ratio"] is None else r["overhead_ratio"] <= TARGET_RATIO
    return r


def run_mesh(rank: int, world: int, port: int, cfg: dict) -> tuple[list, list]:
    """Every case on a 1-d mesh of `world` ranks; returns (rows, problems)."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(cfg["watchdog_s"], exit=True)  # a hang shows where, then ends
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        make = makers(vescale.DeviceMesh("cpu", list(range(world))))
        cases, problems = [], []
        for layout in ("R", "S0"):
            for name, (fn, comm_free_sharded) in OPS.items():
                if layout == "R" or comm_free_sharded:
                    cases.append(prepare_op(name, fn, layout, make, cfg, problems))
            cases.append(prepare_adamw(layout, make, cfg, problems))
        measure(cases, cfg["rounds"])
        check_fallbacks(problems, "while timing")
        for case in cases:
            if case.after:
                case.after()
        return [row(case, world) for case in cases], problems
    finally:
        dist.barrier()  # let every rank finish its collectives before the groups go away
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _rank_main(rank: int, world: int, port: int, cfg: dict, out_path: str) -> None:
    rows, problems = run_mesh(rank, world, port, cfg)
    if rank == 0:  # only rank 0 reports
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "problems": problems}, f)


def print_report(rows: list, problems: list) -> None:
    fmt = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    met = {True: "ok", False: "MISS", None: "?"}
    line = "%-11s %-6s %5s %9s %9s %9s %9s %9s %6s  %s"
    print(line % ("op", "layout", "ranks", "plain", "vescale", "torchDT", "vescale+", "torchDT+", "v+/t+", "targets"))
    print(f"(us per call, medians; X+ = X minus plain; targets: vescale+ <= {TARGET_US:g} us per op, "
          f"v+/t+ <= {TARGET_RATIO:g})")
    for r in rows:
        print(line % (r["op"], r["layout"], r["ranks"], fmt(r["plain_us"]), fmt(r["vescale_us"]), fmt(r["torch_us"]),
                      fmt(r["vescale_overhead_us"]), fmt(r["torch_overhead_us"]), fmt(r["overhead_ratio"], ".3f"),
                      f"{met[r['meets_3us']]}/{met[r['meets_fifth']]}"))
        if r["ops_per_call"] > 1:
            print(f"{'':11s} one step = {r['ops_per_call']} tensor ops: vescale adds "
                  f"{fmt(r['vescale_overhead_per_op_us'], '.2f')} us per op")
    print()
    for key, target in (("meets_3us", f"vescale adds <= {TARGET_US:g} us per op over plain torch"),
                        ("meets_fifth", f"vescale's overhead <= {TARGET_RATIO:g} x torch DTensor's")):
        missed = [f"{r['op']} {r['layout']} x{r['ranks']}" for r in rows if not r[key]]
        print(f"target: {target}: met in {len(rows) - len(missed)}/{len(rows)} rows"
              + (f"; missed: {', '.join(missed)}" if missed else ""))
    print("\nproblems found in vescale:" if problems else "\nno vescale problems (no errors, fallbacks or mismatches)")
    for p in problems:
        print("  - " + p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    cfg = settings(args)

    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    rows, problems = run_mesh(0, 1, free_port(), cfg)  # 1 rank: in this process
    with tempfile.TemporaryDirectory() as tmp:  # 2 ranks: spawned; rank 0 leaves its results here
        out_path = os.path.join(tmp, "rank0.json")
        try:
            mp.spawn(_rank_main, args=(2, free_port(), cfg, out_path), nprocs=2, join=True)
            with open(out_path) as f:
                two = json.load(f)
            rows, problems = rows + two["rows"], problems + two["problems"]
        except Exception as e:  # e.g. the watchdog ended a hung rank: report what we have
            problems.append(f"the 2-rank run failed (its stderr above shows where): {type(e).__name__}: {e}")
    rows.sort(key=lambda r: (r["layout"], list(OPS).index(r["op"]) if r["op"] in OPS else 99, r["ranks"]))
    load = dict(before=load_before, after=os.getloadavg()[0])

    print(f"dispatch overhead: torch {torch.__version__}, gloo, {SIZE}x{SIZE} float32, "
          f"{cfg['rounds'] * cfg['blocks']} blocks of ~{cfg['block_us']} us per stack and op "
          f"(AdamW: {cfg['rounds'] * cfg['adamw_blocks']} single steps){' [--quick]' if args.quick else ''}")
    print(f"1-min load average on {os.cpu_count()} cores: {load['before']:.2f} before, {load['after']:.2f} after\n")
    print_report(rows, problems)
    if args.json:
        meta = dict(torch=torch.__version__, size=SIZE, n_params=N_PARAMS, quick=args.quick, settings=cfg,
                    cpu_count=os.cpu_count(), load_average=load, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "problems": problems}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
