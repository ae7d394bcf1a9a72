"""The planner's finalists, trained: on the ranks at hand the plan chosen is the fastest one
measured, not only the fastest one predicted.

The cost model prices every configuration from one profile of the model. Where ranks
share processors (4 gloo ranks on 2 cores) some kinds of plans measure well off their
prediction (tensor parallelism with ZeRO at 1.6-1.9x, docs/benchmarks.md), while the
plans at the top of the ranking are predicted within a few percent of each other. The
few at the top are cheap to measure next to the profile: each finalist is built with
``vescale.parallelize`` on a copy of the model and trains ``steps`` steps on the sample
batch after one that warms it up (the optimizer's state appears, a pipeline checks its
cut); the slowest rank's time per step, the median over the steps, orders the
finalists. The finalists are the top ``count`` plans with distinct step structure (for
one micro-batch GPipe and 1F1B run the same actions) predicted within ``margin`` of the
best.

A finalist that fails to build or to train on every rank is refused with its error.
One that fails on some ranks only cannot be: the others wait in its collectives, which
the failed ranks can no longer join. The ranks agree on each finalist's outcome through
a group of their own with vescale's collective timeout, so a failed rank that hears
nothing from the others raises, naming the finalist and its error, instead of pairing
its next collective with theirs (the others' collectives time out too). With a memory
limit, a finalist whose measured peak (glibc's counters, CPU) exceeds it is refused too.
Each finalist trains a copy of the model: the model itself is left as it was.
Collective: every rank runs the same finalists in the same order.
"""

from __future__ import annotations

import copy
import functools
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..device_mesh import collective_timeout
from .host_memory import PeakInUse, in_use, malloc_counted
from .calling import batch_size_of, loss_of

__all__ = ["finalists", "run_trials", "ranked_by_trials", "Trial"]


MiB = float(1 << 20)
# how far behind the best predicted step the last finalist may be predicted
MARGIN = 0.5


@dataclass
class Trial:
    """What training one finalist measured: ``step_s`` (the slowest rank's, median over the
    steps), ``steps_s``, ``peak_bytes`` (the fullest rank's, 0 where not measured) or
    ``error``."""
    step_s: float = 0.0
    steps_s: list = field(default_factory=list)
    peak_bytes: int = 0
    error: str = ""


def _schedule_orders(problem: dict) -> dict:
    """(schedule, pp, micro-batches, vp) -> its per-rank actions, as a comparable string."""
    return {(s["name"], s["pp"], s["microbatches"], s["vp"]): repr(s["orders"]) for s in problem.get("schedules", [])}


def _structure(c, schedules: dict) -> tuple:
    """What a candidate's step runs: a schedule's per-rank actions, not its name."""
    cfg = c.config
    base = (cfg["pp"], cfg["dp"], cfg["tp"], bool(cfg["sp"]), cfg["zero"], bool(cfg.get("recompute")))
    if cfg["pp"] == 1:
        return base
    orders = schedules.get((cfg["schedule"], cfg["pp"], cfg["microbatches"], cfg["vp"]))
    return base + (tuple(cfg["blocks_per_stage"]), orders if orders is not None else cfg["schedule"])


def finalists(ranked: list, problem: dict, count: int, margin: float = MARGIN) -> list:
    """The top ``count`` candidates of distinct step structure predicted within ``margin``
    (a fraction) of the best."""
    if not ranked or count <= 0:
        return []
    schedules = _schedule_orders(problem)
    best = ranked[0].step_s
    out, seen = [], set()
    for c in ranked:
        if len(out) == count or c.step_s > best * (1.0 + margin):
            break
        key = _structure(c, schedules)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _rows(batch, start: int, n: int):
    """Samples start .. start + n of ``batch`` (every tensor with its dim 0), cycling through
    it where it holds fewer."""
    size = batch_size_of(batch)
    index = torch.arange(start, start + n) % size
    return tree_map(lambda x: x.index_select(0, index.to(x.device))
                    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size else x, batch)


def _local_batch(pmodel, plan, batch, global_batch: int):
    """This rank's share of the global batch: its data-parallel coordinate's rows."""
    dim = plan["data_parallel.dim"]
    mesh = pmodel.mesh
    dp = mesh.size(dim) if dim in mesh.mesh_dim_names else 1
    r = mesh.get_local_rank(dim) if dp > 1 else 0
    n = global_batch // dp
    return _rows(batch, r * n, n)


def _train(result, candidate, model: nn.Module, batch, loss_fn, steps: int, watch_memory: bool) -> tuple:
    """This rank's step times and peak bytes for one finalist."""
    from ..train import parallelize

    plan = result.to_plan(candidate)
    plan.update({"data.shuffle": False})
    base = in_use()
    pmodel, opt, _, _ = parallelize(plan, copy.deepcopy(model), functools.partial(torch.optim.AdamW, lr=1e-6))
    local = _local_batch(pmodel, plan, batch, result.batch)
    watch = PeakInUse(collectives=True).watch(pmodel) if watch_memory else None
    times = []
    try:
        for i in range(steps + 1):
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            loss_of(pmodel(local), loss_fn).backward()
            opt.step()
            if i:  # the first warms up
                times.append(time.perf_counter() - t)
    finally:
        peak = watch.close() - base if watch is not None else 0
        del pmodel, opt
        gc.collect()
    return times, max(peak, 0)


def run_trials(result, model: nn.Module, batch, cands: list, *, loss_fn=None, steps: int = 3) -> dict:
    """Trains each of ``cands`` on a copy of ``model`` (collective: the same list on every
    rank) and returns {candidate key: Trial}."""
    watch_memory = bool(result.constraints.get("memory_per_device")) and malloc_counted()
    outcomes = dist.new_group(backend="gloo", timeout=collective_timeout())
    out = {}
    try:
        for c in cands:
            try:
                mine = _train(result, c, model, batch, loss_fn, steps, watch_memory)
            except Exception as e:  # noqa: BLE001  (a plan vescale cannot run is refused with the reason)
                mine = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            every = _agree(mine, outcomes, c)
            errors = [e for e in every if isinstance(e, str)]
            if errors:
                out[c.key()] = Trial(error=errors[0])
                continue
            slowest = [max(ts) for ts in zip(*(e[0] for e in every))]
            out[c.key()] = Trial(statistics.median(slowest), slowest, max(e[1] for e in every))
    finally:
        dist.destroy_process_group(outcomes)
    return out


def _agree(mine, group, candidate) -> list:
    """Every rank's outcome of one finalist. A rank whose finalist failed and that hears
    nothing within the group's time limit failed alone: it raises."""
    every = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(every, mine, group=group)
    except RuntimeError as e:
        if not isinstance(mine, str):
            raise
        raise RuntimeError(
            f"vescale.generate_plan: training the finalist {candidate.label} failed on rank {dist.get_rank()} "
            f"({mine}), and the other ranks did not report theirs within the collective timeout "
            f"({collective_timeout().total_seconds():.0f} s): they are waiting in its collectives, which this "
            "rank can no longer join, so planning cannot go on. Constrain the search away from this plan, or "
            "skip the trials with trials=0") from e
    return every


def ranked_by_trials(ranked: list, rejected: list, measured: dict, problem: dict,
                     memory_limit: float) -> tuple[list, list]:
    """(ranked, rejected) after the trials: the trained finalists first, fastest measured
    first, each followed by the plans that run the same actions (GPipe and 1F1B at one
    micro-batch), then the rest as predicted; a finalist that failed, or measured over the
    memory limit, refused with its twins."""
    schedules = _schedule_orders(problem)
    structures = {id(c): _structure(c, schedules) for c in ranked}
    trained = {structures[id(c)]: c for c in ranked if c.key() in measured}
    done, failed = [], []
    for c in ranked:
        trial = measured.get(c.key())
        if trial is None:
            continue
        c.d["trial"] = trial
        if trial.error:
            why = f"failed when trained: {trial.error}"
        elif memory_limit > 0 and trial.peak_bytes > memory_limit:
            why = (f"measured {trial.peak_bytes / MiB:.1f} MiB per rank when trained, over the limit of "
                   f"{memory_limit / MiB:.1f} MiB")
        else:
            done.append(c)
            continue
        c.d["verdict"], c.d["feasible"] = why, False
        failed.append(c)
    refused = {id(c) for c in failed}
    twins: dict = {}
    for c in ranked:
        twin = trained.get(structures[id(c)])
        if twin is not None and twin is not c:
            c.d["verdict"] = f"runs the same actions as {twin.label}"
            if id(twin) in refused:
                c.d["feasible"] = False
                failed.append(c)
            else:
                twins.setdefault(id(twin), []).append(c)
    done.sort(key=lambda c: c.trial.step_s)
    out = []
    for c in done:
        if out:
            c.d["verdict"] = (f"measured {1e3 * c.trial.step_s:.2f} ms per step when trained, "
                              f"{100 * (c.trial.step_s / out[0].trial.step_s - 1):+.1f}% (predicted "
                              f"{100 * (c.step_s / out[0].step_s - 1):+.1f}%)")
        out += [c] + twins.get(id(c), [])
    placed = {id(c) for c in out + failed}
    return out + [c for c in ranked if id(c) not in placed], failed + rejected
