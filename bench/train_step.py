#!/usr/bin/env python
"""Training-step time of a GPT on 4 CPU ranks: vescale's plans vs the same plans built from
torch's own stack (DistributedDataParallel, torch.distributed.tensor.parallel, fully_shard).

    .venv/bin/python bench/train_step.py [--quick] [--json PATH] [--plans P,...] [--size big]
        [--per-parameter-tp-grads] [--profile]

Plans (4 gloo ranks, spawned here; rank 0 reports):

    plan      vescale                                   torch
    DP4       DDP(model, mesh)                          DistributedDataParallel
    DP2xTP2   parallelize_module(gpt_plan) on "TP"      the same TP plan (parallelize_module with
              + DDP on "DP"                             Colwise/RowwiseParallel) + fully_shard on "DP"
    TP4       parallelize_module(gpt_plan), 1-d mesh    the same TP plan, 1-d mesh
    +SP       gpt_plan(sequence_parallel=True)          torch's SequenceParallel LayerNorms,
              (DP2xTP2+SP, TP4+SP)                      PrepareModuleInput, Shard(1) outputs
    ZeRO-2    DDP + DistributedOptimizer(zero_stage=2)  fully_shard(reshard_after_forward=False)
    ZeRO-3    DDP + DistributedOptimizer(zero_stage=3)  fully_shard per block and root

A step is forward + backward + AdamW step + zero_grad on the same seed-0 model and the
same global batch for both stacks. Each plan runs in fresh ranks. Per plan, each stack is
built, warmed up and its memory measured alone (glibc's mmap threshold at 64 KiB, so that
peak RSS is the peak of live tensors, not of heap fragments); then the two take turns step by step (a dist.barrier() before each) so that
load on the shared machine slows them alike. A step's time is the slowest rank's; the table
shows medians and interquartile ranges. A benchmark, never a test: problems are listed, not raised.

--size big: GPT 8 layers x 512 wide, sequence 512, global batch 4 (fewer timed steps).
--per-parameter-tp-grads: vescale without bucketed TP gradients (tp_grads), as before
them: every Partial gradient all-reduced by itself; for comparison.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: 4 ranks share 2 cores

import argparse
import contextlib
import ctypes
import faulthandler
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.models from a checkout

import vescale  # noqa: E402
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module  # noqa: E402
from vescale.parallel.ddp import local_of  # noqa: E402
from vescale.parallel.plans import gpt_plan  # noqa: E402
from examples.models.gpt import GPT, GPTConfig  # noqa: E402
from bench.common import free_port, torch_gpt_tp  # noqa: E402

WORLD = 4
# Compute that is not negligible next to dispatch and communication, yet a step well under
# a second on 2 cores shared by 4 ranks. No biases: a zero-gradient bias turns into
# lr-sized AdamW noise that would blur the loss comparison.
CONFIG = GPTConfig(block_size=128, vocab_size=1024, n_layer=4, n_head=8, n_embd=256, dropout=0.0, bias=False)
GLOBAL_BATCH, SEQ = 8, 128
SIZES = {"small": (CONFIG, GLOBAL_BATCH, SEQ),
         "big": (GPTConfig(block_size=512, vocab_size=1024, n_layer=8, n_head=8, n_embd=512, dropout=0.0, bias=False),
                 4, 512)}
LR = 1e-3
PLANS = ("DP4", "DP2xTP2", "TP4", "ZeRO-2", "ZeRO-3", "DP2xTP2+SP", "TP4+SP")
STACKS = ("torch", "vescale")
LOSS_RTOL = 1e-4  # fp32: both stacks reduce in different orders, so allow rounding


def settings(quick: bool, size: str) -> dict:
    # warmup steps (untimed), memory steps (alone, peak RSS), timed steps per stack;
    # a rank still running after watchdog_s dumps its stack and exits
    if quick:
        return dict(warmup=2, mem_steps=1, timed=5, watchdog_s=600)
    return dict(warmup=3, mem_steps=2, timed=30 if size == "small" else 10, watchdog_s=3600)


def use_size(size: str) -> None:
    global CONFIG, GLOBAL_BATCH, SEQ
    CONFIG, GLOBAL_BATCH, SEQ = SIZES[size]


# ---- memory ----------------------------------------------------------------------------------

_libc = ctypes.CDLL("libc.so.6")


def status_kb() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if v.strip().endswith("kB")}


def settle_memory() -> int:
    """Frees what can be freed and returns it to the OS; returns the anonymous RSS (kB), a
    clean baseline. Anonymous only: file-backed pages are code that the first user of a
    kernel maps in, which would charge shared code to whichever stack runs first."""
    gc.collect()
    _libc.malloc_trim(0)
    return status_kb()["RssAnon"]


def peak_anon_kb() -> int:
    """Anonymous RSS at the peak since reset_peak(): the peak total RSS less the file and
    shared pages now (those were mapped in during the warm-up and stay put since)."""
    st = status_kb()
    return st["VmHWM"] - st["RssFile"] - st["RssShmem"]


def exact_rss(on: bool) -> None:
    """glibc's mmap threshold: at 64 KiB while memory is measured, so every tensor of 64 KiB
    or more gets pages of its own, returned to the OS when freed, and the peak RSS is the
    peak of live tensors (with the default, heap reuse and fragmentation moved peaks by
    +-10 MB between runs and plan orders); 32 MiB, the most the default adapts to, while
    timing, with the heap trimmed only past 64 MiB free (fixing the threshold turns off
    glibc's own adaptation of both, and a trim at every large free makes the next step
    fault its pages in again)."""
    _libc.mallopt(-3, (64 << 10) if on else (32 << 20))  # M_MMAP_THRESHOLD
    _libc.mallopt(-1, (128 << 10) if on else (64 << 20))  # M_TRIM_THRESHOLD


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (peak RSS) to the current RSS
        f.write("5")


def state_bytes(s) -> int:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards;
    storages counted once, so views into flat buffers are not double-counted)."""
    if isinstance(s.opt, DistributedOptimizer):
        return sum(s.opt.memory_bytes().values())
    tensors = [t for p in s.model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for st in s.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        st = (t._local_tensor if isinstance(t, TorchDTensor) else local_of(t)).untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# ---- the two stacks ----------------------------------------------------------------------------

@dataclass
class Setup:
    """One stack's model and optimizer for one plan, and where this rank's batch rows are."""
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    rows: slice
    dp_group: object = None                            # to average the loss over (None: no DP)
    loss_ctx: object = contextlib.nullcontext          # torch TP: loss_parallel
    losses: list = field(default_factory=list)
    times: list = field(default_factory=list)


def dp_rows(dp_rank: int, dp_size: int) -> slice:
    local = GLOBAL_BATCH // dp_size
    return slice(dp_rank * local, (dp_rank + 1) * local)


def new_model() -> GPT:
    torch.manual_seed(0)  # both stacks start from the same weights
    return GPT(CONFIG)


def build_vescale(plan: str, m1, m2) -> Setup:
    model = new_model()
    plan, sp = plan.removesuffix("+SP"), plan.endswith("+SP")
    if plan == "TP4":
        parallelize_module(model, m1, gpt_plan(sequence_parallel=sp))
        return Setup(model, torch.optim.AdamW(model.parameters(), lr=LR), dp_rows(0, 1))
    if plan == "DP2xTP2":
        parallelize_module(model, m2["TP"], gpt_plan(sequence_parallel=sp))
        dp = m2["DP"]
    else:
        dp = m1
    model = DDP(model, dp)
    if plan.startswith("ZeRO"):
        opt = DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=int(plan[-1]), lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return Setup(model, opt, dp_rows(dp.get_local_rank(0), dp.size()), dp.get_group(0))


def torch_fsdp(model: GPT, dp_mesh, reshard_after_forward: bool) -> None:
    for block in model.transformer.h:  # torch's recipe: one FSDP unit per block, plus the root
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def build_torch(plan: str, m1, m2) -> Setup:
    model = new_model()
    t1, t2 = m1.to_torch(), m2.to_torch()  # the very same process groups as vescale's meshes
    plan, sp = plan.removesuffix("+SP"), plan.endswith("+SP")
    if plan == "TP4":
        torch_gpt_tp(model, t1, sequence_parallel=sp)
        return Setup(model, torch.optim.AdamW(model.parameters(), lr=LR), dp_rows(0, 1), loss_ctx=loss_parallel)
    if plan == "DP4":
        model = DistributedDataParallel(model, process_group=t1.get_group(0))
    elif plan == "DP2xTP2":
        # torch's DDP takes no DTensor parameters; torch's 2-D recipe shards over DP instead
        torch_gpt_tp(model, t2["TP"], sequence_parallel=sp)
        torch_fsdp(model, t2["DP"], reshard_after_forward=True)
    else:
        torch_fsdp(model, t1, reshard_after_forward=plan == "ZeRO-3")
    dp = m2["DP"] if plan == "DP2xTP2" else m1
    return Setup(model, torch.optim.AdamW(model.parameters(), lr=LR), dp_rows(dp.get_local_rank(0), dp.size()),
                 dp.get_group(0), loss_parallel if plan == "DP2xTP2" else contextlib.nullcontext)


# ---- the step --------------------------------------------------------------------------------

def batches() -> list:
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(4)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def train_step(s: Setup, batch, zero_grad: bool = True) -> None:
    idx, tgt = batch
    with s.loss_ctx():
        loss = s.model(idx[s.rows], tgt[s.rows])
        loss.backward()
    s.opt.step()
    if zero_grad:
        s.opt.zero_grad(set_to_none=True)
    s.losses.append(loss.detach())  # read after the timing: .item() here would add a sync


def timed_step(s: Setup, batch) -> None:
    dist.barrier()  # every rank starts the step together
    t0 = time.perf_counter()
    train_step(s, batch)
    s.times.append(time.perf_counter() - t0)


def profile_step(s: Setup, batch) -> dict:
    """One step under torch's profiler: collectives by kind, and the ops with most self time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_step(s, batch)
    events = prof.key_averages()
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    return dict(collectives={e.key[6:]: e.count for e in events if e.key.startswith("c10d::")},
                self_ms={e.key: round(e.self_cpu_time_total / 1e3, 1) for e in top})


def loss_values(s: Setup) -> list:
    """The global-batch loss per step. A DTensor loss may be Partial (vescale's loss over
    vocabulary-split logits is) or Replicate (torch's loss_parallel): full_tensor() either
    way. DP ranks average theirs."""
    vals = torch.stack([(v.full_tensor() if isinstance(v, (TorchDTensor, vescale.DTensor)) else v).reshape(())
                        for v in s.losses])
    if s.dp_group is not None:
        dist.all_reduce(vals, group=s.dp_group)
        vals /= dist.get_world_size(s.dp_group)
    return vals.tolist()


# ---- one plan ----------------------------------------------------------------------------------

def prepare(stack: str, plan: str, meshes, data, cfg) -> tuple[Setup, dict]:
    """Builds one stack alone, warms it up, and measures its memory: the peak (anonymous) RSS
    over a few steady steps minus that before it was built, and its parameter+grad+state bytes."""
    exact_rss(True)
    base_kb = settle_memory()
    s = (build_vescale if stack == "vescale" else build_torch)(plan, *meshes)
    for i in range(cfg["warmup"]):
        train_step(s, data[i % len(data)])
    settle_memory()
    reset_peak()
    last = cfg["warmup"] + cfg["mem_steps"] - 1
    for i in range(cfg["warmup"], last + 1):  # the last one keeps its gradients, to count them
        train_step(s, data[i % len(data)], zero_grad=i < last)
    gc.collect()
    mem = dict(peak_mb=(peak_anon_kb() - base_kb) / 1024, state_mb=state_bytes(s) / 2**20,
               rest_mb=(status_kb()["RssAnon"] - base_kb) / 1024)
    exact_rss(False)
    s.opt.zero_grad(set_to_none=True)
    return s, mem


def run_plan(plan: str, meshes, cfg, problems: list) -> dict:
    data = batches()
    vescale.reset_fallback_counts()
    setups, mem = {}, {}
    for stack in STACKS:
        try:
            setups[stack], mem[stack] = prepare(stack, plan, meshes, data, cfg)
        except Exception as e:  # record, never hide: the row shows the stack as missing
            problems.append(f"{plan}: {stack} failed to build or step: {type(e).__name__}: {e}".splitlines()[0])
    first = cfg["warmup"] + cfg["mem_steps"]
    # the machine is shared: measure how much CPU others took while we timed
    wall0, busy0, own0 = time.perf_counter(), busy_cpu_s(), time.process_time()
    for i in range(cfg["timed"]):  # take turns, and alternate who goes first
        for stack in (STACKS if i % 2 == 0 else STACKS[::-1]):
            if stack in setups:
                timed_step(setups[stack], data[(first + i) % len(data)])
    wall, busy, own = time.perf_counter() - wall0, busy_cpu_s() - busy0, time.process_time() - own0
    profiles = {stack: profile_step(s, data[0]) for stack, s in setups.items()} if cfg["profile"] else None
    if vescale.fallback_counts():
        problems.append(f"{plan}: vescale used the replicate fallback for {vescale.fallback_counts()}")
    # a step takes as long as its slowest rank: gather every rank's times and memory
    mine = {stack: dict(times=s.times, losses=loss_values(s), **mem[stack]) for stack, s in setups.items()}
    every = [None] * WORLD
    dist.all_gather_object(every, dict(mine, own_cpu_s=own))
    row = summarize(plan, every, first, problems)
    # busy CPU time not spent by our ranks, as a share of all cores over the timed phase
    row["others_cpu_share"] = max(0.0, busy - sum(r["own_cpu_s"] for r in every)) / (os.cpu_count() * wall)
    if profiles:
        row["profile_rank0"] = profiles if dist.get_rank() == 0 else None
    return row


def summarize(plan: str, every: list, untimed: int, problems: list) -> dict:
    row = dict(plan=plan)
    for stack in STACKS:
        if stack not in every[0]:
            continue
        steps = [max(ts) * 1e3 for ts in zip(*(r[stack]["times"] for r in every))]  # slowest rank
        q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
        row[stack] = dict(ms=q[1], q1=q[0], q3=q[2], steps_ms=steps, losses=every[0][stack]["losses"],
                          peak_mb=max(r[stack]["peak_mb"] for r in every),
                          state_mb=max(r[stack]["state_mb"] for r in every),
                          rest_mb=max(r[stack]["rest_mb"] for r in every))
    if "torch" in row and "vescale" in row:
        row["ratio"] = row["vescale"]["ms"] / row["torch"]["ms"]
        # the stacks took turns, so step i of each ran under about the same load: paired ratios
        pairs = [v / t for v, t in zip(row["vescale"]["steps_ms"], row["torch"]["steps_ms"])]
        row["paired_ratio"] = statistics.median(pairs)
        row["vescale_faster_share"] = sum(r < 1.0 for r in pairs) / len(pairs)
        # the untimed first steps: the same data, before rounding differences grow
        lv, lt = row["vescale"]["losses"][:untimed], row["torch"]["losses"][:untimed]
        row["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(lv, lt))
        if row["loss_rel_diff"] > LOSS_RTOL:
            problems.append(f"{plan}: losses differ by {row['loss_rel_diff']:.1e} (relative): "
                            f"vescale {lv} vs torch {lt}")
    return row


# ---- the ranks and the report ------------------------------------------------------------------

def _rank_main(rank: int, port: int, cfg: dict, plans: list, out_path: str) -> None:
    torch.set_num_threads(1)
    use_size(cfg["size"])  # (a spawned rank imports this module afresh)
    if cfg["per_parameter_tp_grads"]:  # as before tp_grads: the engine reduces each Partial gradient alone
        from vescale.parallel import parallelize as _parallelize
        _parallelize.PartialGradients.install = staticmethod(lambda module, **kwargs: None)
    faulthandler.dump_traceback_later(cfg["watchdog_s"], exit=True)  # a hang shows where, then ends
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        m1 = vescale.DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("DP",))
        m2 = vescale.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("DP", "TP"))
        rows, problems = [], []
        model = new_model()  # one single-device step maps in the kernels both stacks share
        train_step(Setup(model, torch.optim.AdamW(model.parameters(), lr=LR), slice(0, 1)), batches()[0])
        del model
        for plan in plans:
            rows.append(run_plan(plan, (m1, m2), cfg, problems))
            gc.collect()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(dict(rows=rows, problems=problems), f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def print_report(rows: list, problems: list) -> None:
    f = lambda x, spec=".0f": "-" if x is None else format(x, spec)  # noqa: E731
    line = "%-8s %17s %17s %5s %5s %5s %6s %6s %6s %6s %6s %6s %8s %6s  %s"
    print(line % ("plan", "torch ms (IQR)", "vescale ms (IQR)", "v/t", "pair", "won", "peakT", "peakV",
                  "stateT", "stateV", "restT", "restV", "loss rd", "others", "no slower?"))
    for r in rows:
        t, v = r.get("torch", {}), r.get("vescale", {})
        cell = lambda d: f"{f(d.get('ms'))} ({f(d.get('q1'))}-{f(d.get('q3'))})" if d else "-"  # noqa: E731
        ok = "?" if "ratio" not in r else ("yes" if r["ratio"] <= 1.0 else "NO")
        print(line % (r["plan"], cell(t), cell(v), f(r.get("ratio"), ".2f"), f(r.get("paired_ratio"), ".2f"),
                      f(r.get("vescale_faster_share"), ".0%"), f(t.get("peak_mb")),
                      f(v.get("peak_mb")), f(t.get("state_mb"), ".1f"), f(v.get("state_mb"), ".1f"),
                      f(t.get("rest_mb"), ".1f"), f(v.get("rest_mb"), ".1f"), f(r.get("loss_rel_diff"), ".1e"),
                      f(r.get("others_cpu_share"), ".0%"), ok))
    print("\nms: slowest rank's step, median (interquartile range); v/t: vescale / torch medians;\n"
          "pair: median of step-by-step ratios vescale/torch; won: share of those pairs vescale was faster in;\n"
          "peak: max over ranks of peak anonymous RSS (MB) in steady steps minus that before the stack was built;\n"
          "state: MB of parameters + gradients + optimizer state per rank (vescale ZeRO: memory_bytes());\n"
          "rest: anonymous RSS (MB) when state was counted (after the last step, gradients kept) minus\n"
          "that before the stack was built: what state should account for; loss rd: max relative loss\n"
          "difference between the stacks over the untimed first steps; others: CPU other processes took\n"
          "during the timed steps, as a share of all cores (rerun when it is not near 0%)")
    print("\nproblems found:" if problems else "\nno problems found (no errors, fallbacks or loss mismatches)")
    for p in problems:
        print("  - " + p)
    for r in rows:
        for stack, prof in (r.get("profile_rank0") or {}).items():
            print(f"\n{r['plan']} {stack}, one step on rank 0: collectives {prof['collectives']}\n"
                  f"  most self time (ms): {prof['self_ms']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plans", default=",".join(PLANS), help="comma-separated subset of " + ",".join(PLANS))
    ap.add_argument("--profile", action="store_true", help="also profile one more step of each stack")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="the model and batch (see above)")
    ap.add_argument("--per-parameter-tp-grads", action="store_true",
                    help="vescale without bucketed tensor-parallel gradients (for comparison)")
    args = ap.parse_args()
    cfg = dict(settings(args.quick, args.size), profile=args.profile, size=args.size,
               per_parameter_tp_grads=args.per_parameter_tp_grads)
    plans = args.plans.split(",")
    use_size(args.size)

    load_before = os.getloadavg()
    t0 = time.time()
    result = dict(rows=[], problems=[])
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        for plan in plans:  # fresh ranks per plan: no heap state or leftovers of the plan before
            mp.spawn(_rank_main, args=(free_port(), cfg, [plan], out_path), nprocs=WORLD, join=True)
            with open(out_path) as fh:
                one = json.load(fh)
            result["rows"] += one["rows"]
            result["problems"] += one["problems"]
    load = dict(before=load_before, after=os.getloadavg())
    print(f"train step: GPT {CONFIG}, global batch {GLOBAL_BATCH}x{SEQ}, AdamW; torch {torch.__version__}, "
          f"{WORLD} gloo ranks, {cfg['warmup']}+{cfg['mem_steps']} untimed + {cfg['timed']} timed steps per stack"
          f"{' [--quick]' if args.quick else ''}; {time.time() - t0:.0f} s")
    print("load average (1/5/15 min) on %d cores: before %.2f/%.2f/%.2f, after (with this run's ranks) "
          "%.2f/%.2f/%.2f\n"
          % (os.cpu_count(), *load["before"], *load["after"]))
    print_report(result["rows"], result["problems"])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = dict(torch=torch.__version__, config=vars(CONFIG), global_batch=GLOBAL_BATCH, seq=SEQ, lr=LR,
                    settings=cfg, quick=args.quick, cpu_count=os.cpu_count(), load_average=load)
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, **result), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
