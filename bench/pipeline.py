#!/usr/bin/env python
"""Pipeline parallelism on 4 CPU ranks: vescale's PipelineParallel vs torch.distributed.pipelining,
the same manual split, schedule by schedule.

    .venv/bin/python bench/pipeline.py [--quick] [--json PATH] [--profile-rank R]

Schedules (p = 4 pipeline ranks, m = 8 micro-batches):

    vescale                                    torch
    schedule="gpipe"                           ScheduleGPipe
    schedule="1f1b"                            Schedule1F1B
    schedule="interleaved_1f1b", v=2           ScheduleInterleaved1F1B, 2 PipelineStages per rank
    schedule="zb_h1"                           ScheduleInterleavedZeroBubble, 1 PipelineStage per rank
                                               (torch's ZB1P; with one stage per rank it is ZB-H1)

torch's stages are built as torchtitan builds them: a deep copy of the model per stage with
the blocks it does not own deleted (and the embeddings / head set to None off the first /
last stage); vescale gets the whole model and the same split points. Three parts:

1. step time: a small GPT of plain PyTorch blocks (examples/models/gpt.py's Block), forward +
   backward of the whole batch through the schedule. The two stacks take turns step by step
   (a barrier before each), so load on the shared machine slows them alike; a step's time is
   the slowest rank's; medians. The first warm-up step of each stack runs the same batch and
   the gradients of every parameter a rank holds are compared between the stacks.
2. bubble: a model whose blocks sleep instead of computing (2 shared cores would distort
   real compute): forward, input-gradient and weight-gradient each sleep a fixed time per
   block, as separate autograd nodes, so that a split backward (I, then W) really sleeps the
   weight part only in W. Busy time per rank is the time spent inside the sleeps;
   bubble = 1 - sum(busy) / (ranks x step wall time), against the analytic and simulated
   bubble of the schedule.
3. activation memory: on the GPT, one step under torch.autograd.graph.saved_tensors_hooks per
   stack and schedule: per rank the peak bytes saved for backward (live storages, parameters
   excluded) and that peak in micro-batches (peak / bytes one micro-batch saves on the rank),
   against the schedule's own in-flight count.

A benchmark, never a test: problems are listed, not raised.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: 4 ranks share 2 cores

import argparse
import copy
import cProfile
import faulthandler
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.models from a checkout

import vescale  # noqa: E402
from vescale.parallel import PipelineParallel  # noqa: E402
from vescale.parallel.pipeline import analytic_bubble, make_schedule, simulate  # noqa: E402
from examples.models.gpt import Block, GPTConfig  # noqa: E402
from bench.common import free_port  # noqa: E402

WORLD = 4
M = 8                      # micro-batches
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
VIRTUAL = {"interleaved_1f1b": 2}
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved_1f1b": "ScheduleInterleaved1F1B", "zb_h1": "ScheduleInterleavedZeroBubble"}
# 8 blocks: 2 per stage, or 1 per stage with 2 virtual stages per rank. Big enough that a
# block's compute is not lost in dispatch, small enough for a step well under a second.
CONFIG = GPTConfig(block_size=64, vocab_size=1024, n_layer=8, n_head=4, n_embd=128, dropout=0.0, bias=False)
BATCH, SEQ = 16, 64        # 8 micro-batches of 2 sequences
SLEEP_BLOCKS, SLEEP_DIM = 8, 16
GRAD_RTOL = 1e-4


def settings(quick: bool) -> dict:
    return (dict(warmup=2, timed=5, sleep_timed=5, sleep_ms=20.0, watchdog_s=600) if quick
            else dict(warmup=3, timed=15, sleep_timed=7, sleep_ms=20.0, watchdog_s=1800))


def stages_of(schedule: str) -> int:
    return WORLD * VIRTUAL.get(schedule, 1)


def split_points(schedule: str, n_blocks: int) -> list[tuple[int, int]]:
    """Block ranges [a, b) per stage: equal counts (the same manual split for both stacks)."""
    s = stages_of(schedule)
    per = n_blocks // s
    return [(i * per, (i + 1) * per) for i in range(s)]


# ---- the models ----------------------------------------------------------------------------------

class PipeGPT(nn.Module):
    """A GPT of examples/models/gpt.py's blocks, untied embedding and head, written as torchtitan
    writes its models: a stage made by deleting modules (set to None) still runs forward."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def gpt_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Sleeper:
    """Where a rank's sleeping ops record their time."""
    seconds = 0.0
    kinds = {"F": 0, "I": 0, "W": 0}
    per_op = 0.01

    @classmethod
    def sleep(cls, kind: str) -> None:
        t0 = time.perf_counter()
        time.sleep(cls.per_op)
        cls.seconds += time.perf_counter() - t0
        cls.kinds[kind] += 1

    @classmethod
    def reset(cls) -> None:
        cls.seconds, cls.kinds = 0.0, {"F": 0, "I": 0, "W": 0}


class _SleepInput(torch.autograd.Function):
    """y = x * w with w detached: sleeps in forward, and in the input gradient."""

    @staticmethod
    def forward(ctx, x, w):
        if not x.is_meta:  # vescale runs earlier stages' blocks on meta for shapes: no compute there
            Sleeper.sleep("F")
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        Sleeper.sleep("I")
        (w,) = ctx.saved_tensors
        return g * w, None


class _SleepWeight(torch.autograd.Function):
    """Contributes nothing to the output (zeros) but the weight gradient of x * w, sleeping
    while computing it. Its only input that needs a gradient is w: it lies off the path from
    the stage input to the output, so an input-only backward (stage_backward_input) never
    runs it, and the weight backward (stage_backward_weight) runs it alone."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        Sleeper.sleep("W")
        (x,) = ctx.saved_tensors
        return None, (g * x).sum(0)


class SleepBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return _SleepInput.apply(x, self.w.detach()) + _SleepWeight.apply(x.detach(), self.w)


class SleepNet(nn.Module):
    """A linear layer (so the first block's input needs a gradient: the first stage's blocks
    sleep in I like the others), then the sleeping blocks."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([SleepBlock(d) for _ in range(n)])

    def forward(self, x):
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def sleep_loss(out, target):
    return F.mse_loss(out, target)


# ---- the two stacks ----------------------------------------------------------------------------

class Kind:
    """What differs between the GPT and the sleeping model."""

    def __init__(self, name):
        self.name = name
        gpt = name == "gpt"
        self.blocks = "h" if gpt else "layers"
        self.n_blocks = CONFIG.n_layer if gpt else SLEEP_BLOCKS
        self.pre = ("wte", "wpe") if gpt else ("inp",)
        self.post = ("ln_f", "lm_head") if gpt else ()
        self.loss_fn = gpt_loss if gpt else sleep_loss

    def new_model(self) -> nn.Module:
        torch.manual_seed(0)  # both stacks start from the same weights
        return PipeGPT(CONFIG) if self.name == "gpt" else SleepNet(SLEEP_BLOCKS, SLEEP_DIM)

    def batch(self, i: int):
        g = torch.Generator().manual_seed(100 + i)
        if self.name == "gpt":
            d = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g)
            return d[:, :-1].contiguous(), d[:, 1:].contiguous()
        return torch.randn(BATCH, SLEEP_DIM, generator=g), torch.randn(BATCH, SLEEP_DIM, generator=g)


class VescaleStack:
    def __init__(self, kind: Kind, schedule: str, mesh):
        self.kind, self.schedule = kind, schedule
        ranges = split_points(schedule, kind.n_blocks)
        split = [f"{kind.blocks}.{a}" for a, _ in ranges[1:]]
        self.pipe = PipelineParallel(kind.new_model(), mesh, split=split, schedule=schedule, microbatches=M,
                                     virtual_stages=VIRTUAL.get(schedule, 1))
        self.losses = []

    def step(self, batch) -> None:
        x, y = batch
        self.losses.append(self.pipe.step(x, target=y, loss_fn=self.kind.loss_fn))

    def zero_grad(self) -> None:
        for p in self.pipe.parameters():
            p.grad = None

    def grads(self) -> dict:
        return {n: p.grad for n, p in self.pipe.named_parameters()}

    def loss(self) -> float:
        return float(self.losses[-1])


class TorchStack:
    def __init__(self, kind: Kind, schedule: str, group):
        self.kind, self.schedule = kind, schedule
        ranges = split_points(schedule, kind.n_blocks)
        rank, S = group.rank(), len(ranges)
        full = kind.new_model()
        self.stages, self.names = [], {}
        for s in range(rank, S, WORLD):
            mod = copy.deepcopy(full)  # torchtitan: copy the whole model, delete what the stage does not own
            a, b = ranges[s]
            setattr(mod, kind.blocks, nn.ModuleList(list(getattr(mod, kind.blocks))[a:b]))
            if s != 0:
                for n in kind.pre:
                    setattr(mod, n, None)
            if s != S - 1:
                for n in kind.post:
                    setattr(mod, n, None)
            for n, _ in mod.named_parameters():  # the stage's names -> the model's
                parts = n.split(".")
                if parts[0] == kind.blocks:
                    parts[1] = str(a + int(parts[1]))
                self.names[(len(self.stages), n)] = ".".join(parts)
            self.stages.append(PipelineStage(mod, s, S, torch.device("cpu"), group=group))
        del full
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
               "zb_h1": ScheduleInterleavedZeroBubble}[schedule]
        self.sched = cls(self.stages if schedule in ("interleaved_1f1b", "zb_h1") else self.stages[0], M,
                         loss_fn=kind.loss_fn)
        self.is_last = any(st.is_last for st in self.stages)
        self.losses = []

    def step(self, batch) -> None:
        x, y = batch
        losses = [] if self.is_last else None
        self.sched.step(x, target=y, losses=losses, return_outputs=False)
        if losses is not None:
            self.losses.append(torch.stack([v.detach() for v in losses]).mean())

    def zero_grad(self) -> None:
        for st in self.stages:
            st.submod.zero_grad(set_to_none=True)

    def grads(self) -> dict:
        return {self.names[(i, n)]: p.grad for i, st in enumerate(self.stages) for n, p in st.submod.named_parameters()}

    def loss(self) -> float | None:
        return float(self.losses[-1]) if self.losses else None


def timed_step(stack, batch) -> tuple[float, float]:
    """(wall seconds of one step, seconds this rank spent inside sleeping ops)."""
    stack.zero_grad()
    dist.barrier()  # every rank starts the step together
    Sleeper.reset()
    t0 = time.perf_counter()
    stack.step(batch)
    return time.perf_counter() - t0, Sleeper.seconds


def grad_diff(a: dict, b: dict) -> float:
    """Max relative difference of the gradients two stacks give for the same parameters."""
    if set(a) != set(b):
        return float("inf")
    worst = 0.0
    for n in a:
        ga, gb = a[n], b[n]
        if ga is None or gb is None:
            if (ga is None) != (gb is None):
                return float("inf")
            continue
        worst = max(worst, ((ga - gb).abs().max() / gb.abs().max().clamp_min(1e-12)).item())
    return worst


# ---- activation memory -------------------------------------------------------------------------

class SavedBytes:
    """Bytes saved for backward that are alive: storages (counted once) that autograd keeps
    for a backward still to run, parameters excluded. A saved tensor is released when its
    node's backward has run (without retain_graph) or its graph is dropped."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params if not p.is_meta}
        self.refs, self.live, self.peak, self.total = {}, 0, 0, 0

    def pack(self, t):
        if t.is_meta or t.device.type != "cpu":
            return t
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if ptr in self.param_ptrs or n == 0:
            return t
        if ptr not in self.refs:
            self.refs[ptr] = [0, n]
            self.live += n
            self.total += n
            self.peak = max(self.peak, self.live)
        self.refs[ptr][0] += 1
        # detached: a saved output holding its own grad_fn would be a cycle through the C++
        # graph that keeps it alive forever (the graph only needs the values)
        return _Held(t.detach(), self, ptr)

    def release(self, ptr) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t, tracker, ptr):
        self.t = t
        weakref.finalize(self, tracker.release, ptr)


def memory_step(stack, params, batch) -> dict:
    stack.zero_grad()
    gc.collect()
    tracker = SavedBytes(params)
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, SavedBytes.unpack):
        stack.step(batch)
    gc.collect()
    return dict(peak=tracker.peak, per_mb=tracker.total / M, left=tracker.live)


def expected_in_flight(schedule: str) -> list[float]:
    """Per rank, the most micro-batches whose activations the schedule keeps at once, in units
    of one micro-batch through all of the rank's stages (an F adds 1/v, a B or W frees 1/v;
    an I frees nothing: a split backward keeps the graph for W)."""
    v = VIRTUAL.get(schedule, 1)
    sched = make_schedule(schedule, WORLD, M, v)
    out = []
    for order in sched.orders:
        live = peak = 0.0
        for a in order:
            live += 1 / v if a.kind == "F" else -1 / v if a.kind in ("B", "W") else 0.0
            peak = max(peak, live)
        out.append(peak)
    return out


# ---- the ranks ---------------------------------------------------------------------------------

def build(stack: str, kind: Kind, schedule: str, mesh, torch_group):
    return VescaleStack(kind, schedule, mesh) if stack == "vescale" else TorchStack(kind, schedule, torch_group)


def run_schedule(kind: Kind, schedule: str, mesh, torch_group, cfg, problems: list) -> dict:
    """Both stacks on one schedule: warm-up (the first step on the same batch, gradients
    compared), then timed steps taking turns; for the GPT also one memory step each."""
    stacks, out = {}, {}
    for name in ("vescale", "torch"):
        try:
            stacks[name] = build(name, kind, schedule, mesh, torch_group)
            for i in range(cfg["warmup"]):
                timed_step(stacks[name], kind.batch(i))
                if i == 0:
                    out.setdefault("grads0", {})[name] = {n: (g.clone() if g is not None else None)
                                                          for n, g in stacks[name].grads().items()}
                    out.setdefault("loss0", {})[name] = stacks[name].loss()
        except Exception as e:  # noqa: BLE001  record, never hide: the row shows the stack as missing
            problems.append(f"{kind.name} {schedule}: {name} failed: {type(e).__name__}: {e}".splitlines()[0])
            stacks.pop(name, None)
    if len(out.get("grads0", {})) == 2:
        out["grad_rd"] = grad_diff(out["grads0"]["vescale"], out["grads0"]["torch"])
    out.pop("grads0", None)
    n = cfg["timed"] if kind.name == "gpt" else cfg["sleep_timed"]
    times = {name: [] for name in stacks}
    for i in range(n):
        for name in (list(stacks) if i % 2 == 0 else list(stacks)[::-1]):
            times[name].append(timed_step(stacks[name], kind.batch(cfg["warmup"] + i)))
    out["times"] = times
    if kind.name == "gpt":
        out["mem"] = {}
        for name, st in stacks.items():
            params = list(st.pipe.parameters()) if name == "vescale" else [
                p for s in st.stages for p in s.submod.parameters()]
            out["mem"][name] = memory_step(st, params, kind.batch(0))
    if cfg.get("profile_rank") is not None and kind.name == cfg["profile_part"] and schedule == cfg["profile_schedule"]:
        out["profile"] = {name: profile_steps(st, kind, cfg) for name, st in stacks.items()}
    del stacks
    gc.collect()
    return out


def profile_steps(stack, kind: Kind, cfg) -> str | None:
    """cProfile of 3 steps on one rank (the others run them unprofiled)."""
    prof = cProfile.Profile() if dist.get_rank() == cfg["profile_rank"] else None
    for i in range(3):
        stack.zero_grad()
        dist.barrier()
        if prof:
            prof.enable()
        stack.step(kind.batch(i))
        if prof:
            prof.disable()
    if not prof:
        return None
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(18)
    st.sort_stats("cumulative").print_stats(28)
    return s.getvalue()


def _rank_main(rank: int, port: int, cfg: dict, parts: list, schedules: list, out_path: str) -> None:
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(cfg["watchdog_s"], exit=True)  # a hang shows where, then ends
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = vescale.DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("PP",))
        torch_group = dist.new_group(list(range(WORLD)))  # torch's own group: its messages never meet vescale's
        Sleeper.per_op = cfg["sleep_ms"] / 1e3
        results, problems = {}, []
        busy0, own0, wall0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
        for part in parts:
            kind = Kind(part)
            for schedule in schedules:
                results[f"{part}/{schedule}"] = run_schedule(kind, schedule, mesh, torch_group, cfg, problems)
        own, busy, wall = time.process_time() - own0, _busy_cpu_s() - busy0, time.perf_counter() - wall0
        every = [None] * WORLD
        dist.all_gather_object(every, dict(results=results, problems=problems, own_cpu_s=own))
        if rank == 0:
            others = max(0.0, busy - sum(r["own_cpu_s"] for r in every)) / (os.cpu_count() * wall)
            with open(out_path, "w") as f:
                json.dump(dict(every=every, others_cpu_share=others), f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# ---- the report --------------------------------------------------------------------------------

def median_iqr(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[1], q[0], q[2]


def summarize(every: list, parts: list, schedules: list, cfg) -> dict:
    problems = [p for r in every for p in r["problems"]]
    rows = {}
    for part in parts:
        for schedule in schedules:
            key = f"{part}/{schedule}"
            per_rank = [r["results"][key] for r in every]
            row = dict(part=part, schedule=schedule)
            for stack in ("vescale", "torch"):
                if stack not in per_rank[0]["times"]:
                    continue
                steps = list(zip(*(pr["times"][stack] for pr in per_rank)))  # steps x ranks of (wall, busy)
                walls = [max(w for w, _ in st) for st in steps]                # the slowest rank's
                d = dict(ms=[x * 1e3 for x in median_iqr(walls)], steps_ms=[w * 1e3 for w in walls])
                if part == "sleep":
                    bubbles = [1 - sum(b for _, b in st) / (WORLD * wall) for st, wall in zip(steps, walls)]
                    idle = [(WORLD * wall - sum(b for _, b in st)) / WORLD for st, wall in zip(steps, walls)]
                    d.update(bubble=statistics.median(bubbles), idle_ms=statistics.median(idle) * 1e3,
                             busy_ms=statistics.median(sum(b for _, b in st) / WORLD for st in steps) * 1e3)
                if part == "gpt" and "mem" in per_rank[0]:
                    d["mem"] = [pr["mem"][stack] for pr in per_rank]
                row[stack] = d
            if "vescale" in row and "torch" in row:
                row["ratio"] = row["vescale"]["ms"][0] / row["torch"]["ms"][0]
                pairs = [v / t for v, t in zip(row["vescale"]["steps_ms"], row["torch"]["steps_ms"])]
                row["paired_ratio"] = statistics.median(pairs)
            grd = [pr.get("grad_rd") for pr in per_rank]
            if all(g is not None for g in grd):
                row["grad_rd"] = max(grd)
                if row["grad_rd"] > GRAD_RTOL:
                    problems.append(f"{key}: gradients differ between the stacks by {row['grad_rd']:.1e} (relative)")
            losses = per_rank[0].get("loss0", {})
            if losses.get("vescale") is not None:
                last = [pr.get("loss0", {}).get("torch") for pr in per_rank]
                row["loss0"] = dict(vescale=losses["vescale"], torch=last[-1])
            if part == "sleep":
                v = VIRTUAL.get(schedule, 1)
                row["analytic"] = analytic_bubble(schedule, WORLD, M, v)
                row["simulated"] = simulate(make_schedule(schedule, WORLD, M, v))["bubble"]
            if part == "gpt":
                row["expected_in_flight"] = expected_in_flight(schedule)
            prof = [pr.get("profile") for pr in per_rank if pr.get("profile")]
            if prof:
                row["profile"] = {stack: next((p[stack] for p in prof if p.get(stack)), None)
                                  for stack in ("vescale", "torch")}
            rows[key] = row
    return dict(rows=rows, problems=problems)


def print_report(res: dict, parts: list, schedules: list, cfg) -> None:
    rows = res["rows"]
    f = lambda x, spec=".0f": "-" if x is None else format(x, spec)  # noqa: E731
    cell = lambda d: f"{f(d['ms'][0])} ({f(d['ms'][1])}-{f(d['ms'][2])})" if d else "-"  # noqa: E731
    if "gpt" in parts:
        print("1. step time, GPT (forward + backward of the batch through the schedule)\n")
        line = "%-17s %-30s %17s %17s %5s %5s %8s %s"
        print(line % ("schedule", "torch schedule", "torch ms (IQR)", "vescale ms (IQR)", "v/t", "pair",
                      "grad rd", "v <= 1.0x t?"))
        for s in schedules:
            r = rows[f"gpt/{s}"]
            ok = "?" if "ratio" not in r else ("yes" if r["ratio"] <= 1.0 else "NO")
            print(line % (s + (" v=2" if s in VIRTUAL else ""), TORCH_SCHEDULES[s], cell(r.get("torch")),
                          cell(r.get("vescale")), f(r.get("ratio"), ".2f"), f(r.get("paired_ratio"), ".2f"),
                          f(r.get("grad_rd"), ".1e"), ok))
        print("\nms: slowest rank's step, median (interquartile range) over %d steps after %d warm-up steps;\n"
              "v/t: vescale / torch medians; pair: median of step-by-step ratios (the stacks take turns);\n"
              "grad rd: max relative gradient difference between the stacks after the first step (same batch)"
              % (cfg["timed"], cfg["warmup"]))
    if "sleep" in parts:
        print("\n2. bubble, sleeping blocks (%g ms per block in F, in I and in W; %d blocks)\n"
              % (cfg["sleep_ms"], SLEEP_BLOCKS))
        line = "%-17s %8s %8s %8s %8s %8s %8s %8s %8s %s"
        print(line % ("schedule", "analytic", "simul.", "vescale", "torch", "v idle", "t idle", "v ms", "t ms",
                      "vescale within +-10% of analytic?"))
        for s in schedules:
            r = rows[f"sleep/{s}"]
            v, t = r.get("vescale", {}), r.get("torch", {})
            ok = "-" if not v else ("yes" if abs(v["bubble"] - r["analytic"]) <= 0.10 * r["analytic"] else "NO")
            print(line % (s, f(r["analytic"] * 100, ".1f") + "%", f(r["simulated"] * 100, ".1f") + "%",
                          f(v.get("bubble", None) and v["bubble"] * 100, ".1f") + "%",
                          f(t.get("bubble", None) and t["bubble"] * 100, ".1f") + "%",
                          f(v.get("idle_ms")), f(t.get("idle_ms")), f(v.get("ms", [None])[0]),
                          f(t.get("ms", [None])[0]), ok))
        r1, rz = rows.get("sleep/1f1b"), rows.get("sleep/zb_h1")
        if r1 and rz:
            for stack in ("vescale", "torch"):
                if stack in r1 and stack in rz:
                    print(f"{stack}: ZB-H1 / 1F1B: bubble fraction {rz[stack]['bubble'] / r1[stack]['bubble']:.2f}, "
                          f"idle time per rank {rz[stack]['idle_ms'] / r1[stack]['idle_ms']:.2f} (target <= 0.33)")
        print("\nbubble: 1 - (sum over ranks of the time inside sleeping ops) / (ranks x step wall time),\n"
              "median over %d steps; idle: wall - busy per rank (ms); analytic: analytic_bubble (F = I = W);\n"
              "simul.: vescale's simulate() of the schedule's orders (free communication)" % cfg["sleep_timed"])
    if "gpt" in parts:
        print("\n3. activation memory per rank, GPT (bytes saved for backward, one step)\n")
        line = "%-17s %-8s %s"
        print(line % ("schedule", "stack", "per rank: peak MB / in-flight micro-batches (schedule's count)"))
        for s in schedules:
            r = rows[f"gpt/{s}"]
            for stack in ("vescale", "torch"):
                mem = r.get(stack, {}).get("mem")
                if not mem:
                    continue
                cells = [f"{m['peak'] / 2**20:.1f} / {m['peak'] / m['per_mb']:.2f} ({e:g})"
                         for m, e in zip(mem, r["expected_in_flight"])]
                print(line % (s, stack, "   ".join(cells)))
        print("\nin-flight: peak bytes / bytes one micro-batch saves on that rank; the schedule's count: F adds\n"
              "1/v, B or W frees 1/v (an I frees nothing), from vescale's orders")
    print("\nproblems found:" if res["problems"] else "\nno problems found (no errors, gradient mismatches)")
    for p in res["problems"]:
        print("  - " + p)
    for key, r in rows.items():
        for stack, text in (r.get("profile") or {}).items():
            if text:
                print(f"\n---- cProfile, {key}, {stack}, rank {cfg['profile_rank']}, 3 steps ----\n{text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--parts", default="gpt,sleep", help="gpt (time, memory) and/or sleep (bubble)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ",".join(SCHEDULES))
    ap.add_argument("--sleep-ms", type=float, help="sleep per block and pass (default 20)")
    ap.add_argument("--profile-rank", type=int, help="cProfile 3 more steps of each stack on this rank")
    ap.add_argument("--profile-schedule", default="1f1b", help="the schedule to profile (default 1f1b)")
    ap.add_argument("--profile-part", default="gpt", help="the part to profile: gpt (default) or sleep")
    args = ap.parse_args()
    cfg = dict(settings(args.quick), profile_rank=args.profile_rank, profile_schedule=args.profile_schedule,
               profile_part=args.profile_part)
    if args.sleep_ms:
        cfg["sleep_ms"] = args.sleep_ms
    parts, schedules = args.parts.split(","), args.schedules.split(",")

    load_before = os.getloadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank_main, args=(free_port(), cfg, parts, schedules, out_path), nprocs=WORLD, join=True)
        with open(out_path) as fh:
            raw = json.load(fh)
    load = dict(before=load_before, after=os.getloadavg())
    res = summarize(raw["every"], parts, schedules, cfg)
    print(f"pipeline: {WORLD} gloo ranks, m={M} micro-batches; GPT {CONFIG}, batch {BATCH}x{SEQ}; "
          f"torch {torch.__version__}{' [--quick]' if args.quick else ''}; {time.time() - t0:.0f} s")
    print("load average (1/5/15 min) on %d cores: before %.2f/%.2f/%.2f, after (with this run's ranks) "
          "%.2f/%.2f/%.2f; other processes took %.0f%% of all cores during the run\n"
          % (os.cpu_count(), *load["before"], *load["after"], 100 * raw["others_cpu_share"]))
    print_report(res, parts, schedules, cfg)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = dict(torch=torch.__version__, config=vars(CONFIG), batch=BATCH, seq=SEQ, microbatches=M,
                    settings=cfg, quick=args.quick, cpu_count=os.cpu_count(), load_average=load,
                    others_cpu_share=raw["others_cpu_share"])
        for r in res["rows"].values():
            r.pop("profile", None)
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, **res), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
