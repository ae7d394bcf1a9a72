#!/usr/bin/env python
"""The eager planner against measurement on 4 gloo ranks: ``vescale.generate_plan``'s
prediction for every feasible plan of a model, and each plan trained and timed.

    .venv/bin/python bench/autoplan.py [--quick | --plans N] [--models gpt,llama,qwen2] [--rounds 2] [--json PATH]
                                       [--transfer]

Per model (the project's GPT and Llama, a Hugging Face Qwen2; 4 ranks spawned here, one
thread each, on a machine that may be shared):

1. plan: ``vescale.autoplan.plan_eager`` on the 4 ranks (profile, gloo collectives,
   what-if runs, C++ search); planning time is its wall time on rank 0;
2. measure every plan the search ranked (every feasible configuration of its space: mesh
   factorisation, ZeRO stage, sequence parallelism, schedule, micro-batches, with the
   planner's split; with ``--plans N``, its top 6, the two baselines and the rest spread
   evenly over the ranking, N in all), in a random order, ``--rounds`` times: ``vescale.parallelize`` on a
   fresh seed-0 model, 2 warm-up steps, then timed steps (a barrier before each; a step
   takes as long as its slowest rank; the median of the steps); memory: the most bytes malloc had handed out
   (glibc mallinfo2, sampled at every module's forward start and end, every gradient's
   accumulation, around the optimizer step and around every collective Python issues)
   during the two warm-up steps (the
   optimizer's state is made in the first), less those in use before the plan was built,
   the largest rank's; and the resident memory that stays per timed step
   (tensor-parallel steps leak, see docs/benchmarks.md);
3. compare: regret of the planner's choice (its measured step over the best measured),
   Kendall's tau between predicted and measured step times, the predicted peak memory
   against the measured, the noise floor (how much the rounds of one plan disagree), a
   Megatron-style heuristic (TP inside the node: TP4 on one node of 4 ranks) and all-ZeRO-3
   (DP4 ZeRO-3), and a memory limit that the plan chosen under it must respect;

``--transfer``: "profile model A, plan model B". Per model, A is the model above and B the
same architecture 1.5x as deep and as wide (6 layers, 384 wide), built on meta: the
planner plans B from A's answer (``plan_eager(B, ..., like=A's)``: times scaled by FLOPs,
shapes and collectives from what-if runs of B), and from B's own profile as well; B's
plans (the derived ranking sampled as above, B's own choice added) are measured, and both
predictions compared with the measurements and with each other.

A benchmark, never a test: misses are reported, not raised.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: 4 ranks share 2 cores

import argparse
import ctypes
import faulthandler
import functools
import gc
import json
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.models from a checkout

import vescale  # noqa: E402
import vescale.train as _train  # noqa: E402
from vescale.autoplan import plan_eager  # noqa: E402
from vescale.autoplan.eager import EagerCandidate  # noqa: E402
from vescale.autoplan.host_memory import PeakInUse, in_use  # noqa: E402
from bench.common import free_port  # noqa: E402

WORLD = 4
LR = 1e-3
SEQ = 64
BATCH = 8


# ---- models --------------------------------------------------------------------------------------

def _gpt(n_layer=4, n_embd=256):
    from examples.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=2048, n_layer=n_layer, n_head=8, n_embd=n_embd, dropout=0.0,
                         bias=False))


def _llama(layers=4, hidden=256):
    from examples.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=SEQ))


def _qwen2(layers=4, hidden=256):
    import transformers as tf
    torch.manual_seed(0)
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden,
                                              num_hidden_layers=layers, num_attention_heads=8,
                                              num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False))


MODELS = {"gpt": (_gpt, "tuple"), "llama": (_llama, "tuple"), "qwen2": (_qwen2, "hf")}
TRANSFER_B = (6, 384)  # --transfer: model B is 1.5x as deep and as wide as the benchmark's model


def _data(kind: str, n: int):
    g = torch.Generator().manual_seed(3)
    d = torch.randint(0, 2048, (n, SEQ + 1), generator=g)
    if kind == "hf":
        ids = d[:, :-1].contiguous()
        return _Tokens(ids), {"input_ids": ids[:BATCH], "labels": ids[:BATCH]}
    x, y = d[:, :-1].contiguous(), d[:, 1:].contiguous()
    return torch.utils.data.TensorDataset(x, y), (x[:BATCH], y[:BATCH])


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# ---- memory (as bench/train_step.py measures it) --------------------------------------------------

_libc = ctypes.CDLL("libc.so.6")


def _status_kb() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if v.strip().endswith("kB")}


def settle_memory() -> int:
    gc.collect()
    _libc.malloc_trim(0)
    return _status_kb()["RssAnon"]


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_anon_kb() -> int:
    st = _status_kb()
    return st["VmHWM"] - st["RssFile"] - st["RssShmem"]


# ---- measuring one plan ---------------------------------------------------------------------------

_meshes: dict = {}


def _cached_mesh(plan, world):
    """vescale.parallelize makes a mesh (new process groups) per call: reuse one per shape,
    so that hundreds of plans do not pile up gloo groups."""
    dims = tuple((plan["mesh"] or {plan["data_parallel.dim"]: world}).items())
    if dims not in _meshes:
        _meshes[dims] = _orig_mesh(plan, world)
    return _meshes[dims]


_orig_mesh = _train._mesh
_train._mesh = _cached_mesh
_groups: dict = {}
_orig_new_group = dist.new_group


def _cached_new_group(ranks=None, *args, **kwargs):
    """The pipeline makes a group per set of ranks that share parameters, per plan: the same
    few sets every time, so one group each (group creation costs seconds on gloo)."""
    key = tuple(ranks) if ranks is not None else None
    if key is None or args or kwargs:
        return _orig_new_group(ranks, *args, **kwargs)
    if key not in _groups:
        _groups[key] = _orig_new_group(ranks)
    return _groups[key]


dist.new_group = _cached_new_group


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def measure(result, cand: EagerCandidate, make, kind: str, steps: int) -> dict:
    plan = result.to_plan(cand)
    plan.update({"data.shuffle": False})
    dataset, _ = _data(kind, BATCH * (steps + 3))
    settle_memory()
    base = in_use()
    t_build = time.perf_counter()
    model = make()
    model, opt, _, loader = vescale.parallelize(plan, model, functools.partial(torch.optim.AdamW, lr=LR), None,
                                                dataset)
    build_s = time.perf_counter() - t_build
    times, losses = [], []
    it = iter(loader)
    watch = PeakInUse(collectives=True).watch(model)  # the peak of the first two steps (the optimizer's state appears in the first)
    peak = growth_from = None
    for i in range(2 + steps):
        batch = next(it)
        if i == 2:
            peak = (watch.close() - base) // 1024
            growth_from = settle_memory()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = _loss(model(batch))
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if i >= 2:
            times.append(t1 - t0)
        losses.append(float((loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss).detach()))
    growth = (settle_memory() - growth_from) / max(steps, 1)  # resident memory that stays, per step
    del model, opt, loader, it
    settle_memory()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, peak, losses[0], build_s, growth))
    slowest = [max(ts) for ts in zip(*(e[0] for e in every))]
    return {"step_s": statistics.median(slowest), "steps_s": slowest, "peak_bytes": max(e[1] for e in every) * 1024,
            "rank_peak_bytes": [e[1] * 1024 for e in every], "first_loss": every[0][2], "build_s": every[0][3],
            "growth_bytes_per_step": max(e[4] for e in every) * 1024}


# ---- statistics -----------------------------------------------------------------------------------

def kendall_tau(a: list, b: list) -> float:
    """Kendall's tau-b."""
    n = len(a)
    conc = disc = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


# what the planner is compared with: TP inside the node (one node of 4 ranks), and all-ZeRO-3
BASELINES = {"megatron_heuristic": dict(pp=1, dp=1, tp=4, sp=False, zero=0),
             "all_zero3": dict(pp=1, dp=4, tp=1, zero=3)}


def _find(ranked, **want):
    for c in ranked:
        cfg = c.config
        if all(cfg.get(k) == v for k, v in want.items()):
            return c
    return None


# ---- one model ------------------------------------------------------------------------------------

def sample(result, limit: int) -> list:
    """The plans to measure: all, or the predicted top 6, the two baselines, and the rest
    evenly over the ranking, ``limit`` in all."""
    cands = list(result.ranked)
    if limit and len(cands) > limit:
        keep = cands[:6] + [c for c in (_find(cands, **BASELINES["megatron_heuristic"]),
                                         _find(cands, **BASELINES["all_zero3"])) if c is not None]
        rest = [c for c in cands if all(c is not x for x in keep)]
        n = max(limit - len(keep), 1)
        keep += [rest[round(i * (len(rest) - 1) / max(n - 1, 1))] for i in range(n)] if rest else []
        cands = sorted({id(c): c for c in keep}.values(), key=lambda c: c.step_s)
    return cands


def measure_all(result, cands: list, make, kind: str, cfg: dict, log) -> tuple[list, dict]:
    """Every candidate trained ``cfg['rounds']`` times in a random order: rows for analyse()."""
    keys = [c.key() for c in cands]
    rng = random.Random(cfg["seed"])
    # a throwaway plan first: the first step in a process allocates for good (thread pools,
    # kernels' buffers, lazy imports), which would count against whichever plan came first
    measure(result, cands[0], make, kind, 1)
    measured: dict = {k: [] for k in keys}
    failures: dict = {}
    for rnd in range(cfg["rounds"]):
        order = list(range(len(cands)))
        rng.shuffle(order)
        for n, i in enumerate(order):
            c = cands[i]
            if keys[i] in failures:
                continue
            try:
                m = measure(result, c, make, kind, cfg["steps"])
            except Exception as e:  # noqa: BLE001  (recorded: a plan vescale cannot run is a finding)
                failures[keys[i]] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"  round {rnd} {c.label}: FAILED {failures[keys[i]]}")
                dist.barrier()
                continue
            measured[keys[i]].append(m)
            log(f"  round {rnd} [{n + 1}/{len(cands)}] {c.label:42s} predicted {1e3 * c.step_s:8.2f} ms  measured "
                f"{1e3 * m['step_s']:8.2f} ms  memory predicted {c.memory['total'] / 2**20:7.1f} MiB measured "
                f"{m['peak_bytes'] / 2**20:7.1f} MiB")
    rows = []
    for c, k in zip(cands, keys):
        ms = measured[k]
        if not ms:
            continue
        step = statistics.mean(m["step_s"] for m in ms)
        rows.append(dict(label=c.label, key=list(k), predicted_s=c.step_s, measured_s=step,
                         rounds_s=[m["step_s"] for m in ms], predicted_bytes=c.memory["total"],
                         measured_bytes=statistics.mean(m["peak_bytes"] for m in ms),
                         predicted_rank_bytes=[r["total"] for r in c.rank_memory],
                         first_loss=ms[0]["first_loss"], verdict=c.verdict,
                         growth_bytes_per_step=max(m["growth_bytes_per_step"] for m in ms)))
    return rows, {str(k): v for k, v in failures.items()}


def run_model(name: str, cfg: dict, log) -> dict:
    make, kind = MODELS[name]
    _, batch = _data(kind, BATCH)
    model = make()
    dist.barrier()
    t0 = time.perf_counter()
    result = plan_eager(model, batch, world=WORLD, trials=cfg["trials"])
    planning_s = time.perf_counter() - t0
    log(f"[{name}] planned in {planning_s:.2f} s")
    log(str(result))
    del model
    rows, failures = measure_all(result, sample(result, cfg["limit_plans"]), make, kind, cfg, log)
    return dict(model=name, planning_s=planning_s, planning_breakdown=result.seconds, rows=rows,
                failures=failures, choice=result.best.label,
                choice_key=list(result.best.key()), profile=result.profile.summary(), comm=str(result.comm),
                tp=[ch.describe() for (tp, sp), ch in sorted(result.tp_choices.items()) if not sp],
                analysis=analyse(rows, result))


def run_transfer(name: str, cfg: dict, log) -> dict:
    """Profile model A (the benchmark's model), plan model B (deeper and wider, built on
    meta, never run by the planner) from A's timings; B also planned from its own profile;
    B's plans measured; both plannings compared with the measurements."""
    make, kind = MODELS[name]
    layers, hidden = TRANSFER_B
    make_b = functools.partial(make, layers, hidden)
    _, batch = _data(kind, BATCH)
    dist.barrier()
    t0 = time.perf_counter()
    small = plan_eager(make(), batch, world=WORLD)
    t1 = time.perf_counter()
    with torch.device("meta"):
        meta_b = make_b()
    derived = plan_eager(meta_b, batch, world=WORLD, like=small)
    t2 = time.perf_counter()
    own = plan_eager(make_b(), batch, world=WORLD, comm=small.comm)
    t3 = time.perf_counter()
    log(f"[{name} B: {layers} layers, {hidden} wide] A planned in {t1 - t0:.2f} s, B from A's profile in "
        f"{t2 - t1:.2f} s, B from its own in {t3 - t2:.2f} s")
    log(str(derived))
    cands = sample(derived, cfg["limit_plans"])
    if all(c.key() != own.best.key() for c in cands):  # B's own choice is measured too
        cands += [c for c in derived.ranked if c.key() == own.best.key()]
    rows, failures = measure_all(derived, cands, make_b, kind, cfg, log)
    predicted_own = {c.key(): c for c in own.ranked}
    own_rows = [dict(r, predicted_s=predicted_own[tuple(r["key"])].step_s,
                     predicted_bytes=predicted_own[tuple(r["key"])].memory["total"])
                for r in rows if tuple(r["key"]) in predicted_own]
    both = [k for k in (c.key() for c in derived.ranked) if k in predicted_own]
    d_pred = {c.key(): c.step_s for c in derived.ranked}
    return dict(model=name, b=dict(layers=layers, hidden=hidden), planning_s=dict(a=t1 - t0, b_from_a=t2 - t1,
                                                                                  b_own=t3 - t2),
                rows=rows, failures=failures, choice_from_a=derived.best.label, choice_own=own.best.label,
                tau_between_predictions=kendall_tau([d_pred[k] for k in both],
                                                    [predicted_own[k].step_s for k in both]),
                analysis=analyse(rows, derived), analysis_own=analyse(own_rows, own))


def analyse(rows: list, result) -> dict:
    if not rows:
        return {}
    best = min(rows, key=lambda r: r["measured_s"])
    chosen = next((r for r in rows if tuple(r["key"]) == result.best.key()), None)
    tau = kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    noise = [abs(r["rounds_s"][0] - r["rounds_s"][1]) / statistics.mean(r["rounds_s"][:2])
             for r in rows if len(r["rounds_s"]) > 1]
    mem_err = [r["predicted_bytes"] / r["measured_bytes"] - 1 for r in rows if r["measured_bytes"] > 0]
    step_err = [r["predicted_s"] / r["measured_s"] - 1 for r in rows]
    by_measured = sorted(rows, key=lambda r: r["measured_s"])
    out = dict(plans=len(rows), tau=tau, best_measured=best["label"], best_measured_s=best["measured_s"],
               chosen=chosen["label"] if chosen else result.best.label,
               chosen_measured_s=chosen["measured_s"] if chosen else None,
               regret=(chosen["measured_s"] / best["measured_s"] - 1) if chosen else None,
               chosen_rank_measured=(by_measured.index(chosen) + 1) if chosen else None,
               noise_median=statistics.median(noise) if noise else None,
               noise_p90=sorted(noise)[int(0.9 * (len(noise) - 1))] if noise else None,
               memory_error_median=statistics.median(abs(e) for e in mem_err) if mem_err else None,
               memory_within_10pct=sum(abs(e) <= 0.10 for e in mem_err) / len(mem_err) if mem_err else None,
               memory_error_signed_median=statistics.median(mem_err) if mem_err else None,
               step_error_median=statistics.median(abs(e) for e in step_err),
               top3_measured=[r["label"] for r in by_measured[:3]])
    for name, want in BASELINES.items():
        c = _find(result.ranked, **want)
        row = next((r for r in rows if c is not None and tuple(r["key"]) == c.key()), None)
        out[name] = dict(label=c.label if c else None, predicted_s=c.step_s if c else None,
                         measured_s=row["measured_s"] if row else None,
                         vs_best=(row["measured_s"] / best["measured_s"] - 1) if row else None)
    return out


def memory_limit_check(name: str, cfg: dict, log) -> dict:
    """Plans under a memory limit below the unconstrained choice's prediction; the chosen plan
    must measure under it."""
    make, kind = MODELS[name]
    _, sample = _data(kind, BATCH)
    model = make()
    free = plan_eager(model, sample, world=WORLD)
    limit = 0.8 * free.best.memory["total"]
    limited = plan_eager(model, sample, world=WORLD, constraints={"memory_per_device": int(limit)},
                         profile=free.profile, comm=free.comm)
    del model
    if not limited.ranked:
        return dict(limit_bytes=limit, chosen=None, note="no plan fits")
    m = measure(limited, limited.best, make, kind, cfg["steps"])
    log(f"[{name}] memory limit {limit / 2**20:.1f} MiB: chose {limited.best.label}, predicted "
        f"{limited.best.memory['total'] / 2**20:.1f} MiB, measured {m['peak_bytes'] / 2**20:.1f} MiB")
    return dict(limit_bytes=limit, chosen=limited.best.label, predicted_bytes=limited.best.memory["total"],
                measured_bytes=m["peak_bytes"], within=m["peak_bytes"] <= limit)


# ---- ranks ----------------------------------------------------------------------------------------

def _rank_main(rank: int, port: int, cfg: dict, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(cfg["watchdog_s"], exit=True)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    logs = []

    def log(msg):
        if rank == 0:
            print(msg, flush=True)
            logs.append(msg)
    results = {}
    for name in cfg["models"]:
        if cfg["transfer"]:
            results[name] = run_transfer(name, cfg, log)
            if rank == 0:
                with open(out_path, "w") as f:
                    json.dump(dict(results=results, cfg=cfg), f, indent=1, default=str)
            continue
        results[name] = run_model(name, cfg, log)
        if cfg["memory_limit"]:
            results[name]["memory_limit"] = memory_limit_check(name, cfg, log)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(dict(results=results, cfg=cfg), f, indent=1, default=str)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round, 12 plans spread over the ranking")
    ap.add_argument("--plans", type=int, default=0,
                    help="measure N plans spread evenly over the ranking (the planner's choice included); 0: all")
    ap.add_argument("--models", default="gpt,llama,qwen2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory-limit", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trials", type=int, default=0,
                    help="the planner trains its N best predicted plans and chooses the fastest (generate_plan(trials=N))")
    ap.add_argument("--transfer", action="store_true",
                    help="profile each model, plan a deeper and wider one from its timings (never running it), "
                         "measure the latter's plans")
    args = ap.parse_args()
    cfg = dict(models=args.models.split(","), rounds=1 if args.quick else args.rounds, steps=args.steps,
               seed=args.seed, limit_plans=12 if args.quick else args.plans, memory_limit=not args.no_memory_limit,
               watchdog_s=7200, transfer=args.transfer, trials=args.trials)
    out_path = args.json or tempfile.mktemp(suffix=".json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    print(f"load average before: {os.getloadavg()}; results -> {out_path}", flush=True)
    t0 = time.time()
    mp.spawn(_rank_main, args=(free_port(), cfg, out_path), nprocs=WORLD, join=True)
    with open(out_path) as f:
        data = json.load(f)
    print(f"\n==== summary ({time.time() - t0:.0f} s, load average after: {os.getloadavg()})")
    for name, r in data["results"].items():
        if cfg["transfer"]:
            _print_transfer(name, r)
            continue
        a = r["analysis"]
        print(f"{name}: {a['plans']} plans measured; planner chose {a['chosen']} (measured rank "
              f"{a['chosen_rank_measured']}), best measured {a['best_measured']}; regret "
              f"{_pct(a['regret'])}; Kendall tau {a['tau']:.3f}; noise floor median {_pct(a['noise_median'])} "
              f"(p90 {_pct(a['noise_p90'])}); step error median {_pct(a['step_error_median'])}; memory error "
              f"median {_pct(a['memory_error_median'])} (signed {_pct(a['memory_error_signed_median'])}), within 10%: "
              f"{_pct(a['memory_within_10pct'])}; planning {r['planning_s']:.2f} s")
        for h in ("megatron_heuristic", "all_zero3"):
            x = a[h]
            print(f"   {h}: {x['label']}: measured {_ms(x['measured_s'])} ({_pct(x['vs_best'])} over the best)")
        if r.get("memory_limit"):
            print(f"   memory limit: {r['memory_limit']}")
        if r["failures"]:
            print(f"   failed plans: {r['failures']}")
    return 0


def _print_transfer(name: str, r: dict) -> None:
    a, o = r["analysis"], r["analysis_own"]
    print(f"{name} B ({r['b']['layers']} layers, {r['b']['hidden']} wide): {a['plans']} plans measured, best "
          f"{a['best_measured']}; planning A {r['planning_s']['a']:.2f} s, B from A {r['planning_s']['b_from_a']:.2f} s")
    for label, x in (("from A's profile", a), ("from its own profile", o)):
        print(f"   {label:22s} chose {x['chosen']} (measured rank {x['chosen_rank_measured']}): regret "
              f"{_pct(x['regret'])}, Kendall tau {x['tau']:.3f}, step error median {_pct(x['step_error_median'])}, "
              f"memory within 10%: {_pct(x['memory_within_10pct'])} (median error {_pct(x['memory_error_median'])})")
    print(f"   Kendall tau between the two predictions: {r['tau_between_predictions']:.3f}; noise floor median "
          f"{_pct(a['noise_median'])}")
    if r["failures"]:
        print(f"   failed plans: {r['failures']}")


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ms(x):
    return "n/a" if x is None else f"{1e3 * x:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
