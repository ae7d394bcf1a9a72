"""``vescale.generate_plan``: a parallel plan for the ranks at hand, from the model's own
eager execution.

    plan = vescale.generate_plan({"world_size": 4, "memory_per_device": "2GB"}, model,
                                 sample_batch=(input_ids, targets))
    print(plan)            # the plan, then the predicted step and memory, runners-up and why they lost
    model, opt, _, _ = vescale.parallelize(plan, model, torch.optim.AdamW)

What happens (every rank calls it when torch.distributed runs; all return the same plan):

1. the model trains a few steps on the sample batch as it is (``profile.profile_model``):
   per-unit forward / backward times at two batch sizes, saved activations, parameters,
   legal pipeline cuts;
2. the collectives of the backend are measured on the ranks (``commfit.measure_comm``):
   alpha-beta per kind and group size;
3. for each tensor-parallel degree (with and without sequence parallelism), what-if runs
   on meta tensors over a virtual mesh choose the layers' sharding (Megatron's pairs
   come out of the rules' costs) and read off each unit's collectives; the same plan on
   real local shards over the virtual mesh times each unit's local compute
   (``virtual``, ``tp_search``, ``whatif``); the ranks share this work;
4. the C++ search (``autoplan/eager.h``) prices every mesh factorisation, ZeRO stage,
   sequence parallelism, schedule, micro-batch count and split on the pipeline timeline,
   under the memory limit, and ranks them;
5. with ``trials=N``, on the ranks at hand, the N best predicted plans are trained a few
   steps each and the fastest measured is chosen.

Constraints fix what they name (``CONSTRAINTS`` lists the keys); anything else is searched.
"""

from __future__ import annotations

import difflib
import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C
from ..parallel.pipeline.schedules import SCHEDULES, make_schedule
from ..plan import SCHEMA, Plan, PlanError
from .commfit import CommModel, measure_comm
from .calling import batch_size_of, slice_batch
from .profile import Profile, profile_model
from .scale import parse_bytes
from .transfer import profile_like, scaled_sharded_lines
from .trials import finalists, ranked_by_trials, run_trials
from .split_backward import sharded_held_for_weights
from .timing import line_through
from .tp_search import tensor_parallel_plan
from .whatif import sharded_saved, sharded_times, unit_collectives

__all__ = ["generate_plan", "plan_eager", "EagerPlan", "EagerCandidate", "CONSTRAINTS", "plan_for"]

MiB = float(1 << 20)
# how many of the best predicted plans generate_plan(trials=...) trains before choosing,
# by default (0: none; in the one bench run so far, 3 steps each could not separate
# finalists closer than the noise, docs/benchmarks.md)
TRIALS = 0

# constraint -> what it fixes
CONSTRAINTS = {
    "world_size": "ranks (must match world=... and torch.distributed)",
    "memory_per_device": "bytes per rank, e.g. '2GB' / '512MiB' (plans that need more are refused)",
    "mesh.PP": "pipeline-parallel size", "pipeline_parallel.size": "pipeline-parallel size",
    "mesh.DP": "data-parallel size", "data_parallel.size": "data-parallel size",
    "mesh.TP": "tensor-parallel size", "tensor_parallel.size": "tensor-parallel size",
    "data_parallel.zero_stage": "0-3",
    "tensor_parallel.sequence_parallel": "True / False",
    "tensor_parallel.sharding_policy": "'megatron': every linear layer split, the pairs of least communication",
    "pipeline_parallel.schedule": f"one of {list(SCHEDULES)}",
    "pipeline_parallel.microbatches": "micro-batches per step",
    "pipeline_parallel.virtual_stages": "stages per pipeline rank",
    "pipeline_parallel.split_method": "'time' (measured, balanced under the memory limit), 'uniform', 'flops', "
                                      "'parameters'",
    "data.global_batch_size": "samples per step (default: the sample batch's)",
    "recompute": "True / False: every block checkpointed (default: only where a plan does not fit without it)",
}
_SIZE_KEYS = {"mesh.PP": "pp", "pipeline_parallel.size": "pp", "mesh.DP": "dp", "data_parallel.size": "dp",
              "mesh.TP": "tp", "tensor_parallel.size": "tp", "pipeline_parallel.microbatches": "microbatches",
              "pipeline_parallel.virtual_stages": "vp"}
_SPLITS = ("time", "uniform", "flops", "parameters")


def _check_constraints(constraints: dict) -> dict:
    if not isinstance(constraints, dict):
        raise PlanError(f"generate_plan's constraints must be a dict, e.g. {{'world_size': 4}}; got "
                        f"{type(constraints).__name__}")
    out: dict = {}
    for key, value in constraints.items():
        if key not in CONSTRAINTS:
            close = difflib.get_close_matches(str(key), list(CONSTRAINTS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PlanError(f"unknown planner constraint {key!r}; {hint}valid keys: {sorted(CONSTRAINTS)}")
        if key in _SIZE_KEYS or key in ("world_size", "data.global_batch_size"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"planner constraint {key!r} is {value!r}; expected an integer >= 1")
            if key in _SIZE_KEYS:
                name = _SIZE_KEYS[key]
                if name in out and out[name] != value:
                    raise PlanError(f"planner constraint {key!r} is {value} but another key fixes {name} to "
                                    f"{out[name]}")
                out[name] = value
            else:
                out[key] = value
        elif key == "memory_per_device":
            try:
                out["memory_limit"] = parse_bytes(value)
            except ValueError as e:
                raise PlanError(f"planner constraint 'memory_per_device': {e}") from None
        elif key == "data_parallel.zero_stage":
            if value not in (0, 1, 2, 3) or isinstance(value, bool):
                raise PlanError(f"planner constraint 'data_parallel.zero_stage' is {value!r}; expected 0, 1, 2 or 3")
            out["zero"] = value
        elif key == "tensor_parallel.sequence_parallel":
            if not isinstance(value, bool):
                raise PlanError(f"planner constraint 'tensor_parallel.sequence_parallel' is {value!r}; expected "
                                f"True or False")
            out["sp"] = int(value)
        elif key == "tensor_parallel.sharding_policy":
            if value != "megatron":
                raise PlanError(f"planner constraint 'tensor_parallel.sharding_policy' is {value!r}; the eager "
                                f"planner knows 'megatron' (every linear layer split, the layouts of least "
                                f"communication found by what-if runs)")
        elif key == "pipeline_parallel.schedule":
            if value not in SCHEDULES:
                raise PlanError(f"planner constraint 'pipeline_parallel.schedule' is {value!r}; expected one of "
                                f"{list(SCHEDULES)}")
            out["schedule"] = value
        elif key == "recompute":
            if not isinstance(value, bool):
                raise PlanError(f"planner constraint 'recompute' is {value!r}; expected True or False")
            out["recompute"] = int(value)
        elif key == "pipeline_parallel.split_method":
            if value not in _SPLITS:
                raise PlanError(f"planner constraint 'pipeline_parallel.split_method' is {value!r}; expected one "
                                f"of {list(_SPLITS)}")
            out["split"] = value
    return out


# ---- results -------------------------------------------------------------------------------------

@dataclass
class EagerCandidate:
    """One configuration the planner priced: ``config`` (pp, dp, tp, sp, zero, schedule,
    microbatches, vp, blocks_per_stage), predicted ``step_s``, ``memory`` (bytes of the
    rank that holds the most, by kind), ``rank_memory`` (per pipeline rank), ``breakdown``
    (seconds by what they are spent on), ``verdict`` (why it lost, or why it was refused)."""

    d: dict

    config = property(lambda self: self.d["config"])
    step_s = property(lambda self: self.d["step_s"])
    memory = property(lambda self: self.d["memory"])
    rank_memory = property(lambda self: self.d["rank_memory"])
    breakdown = property(lambda self: self.d["breakdown"])
    verdict = property(lambda self: self.d["verdict"])
    label = property(lambda self: self.d["label"])
    feasible = property(lambda self: self.d["feasible"])
    bubble = property(lambda self: self.d["bubble"])
    trial = property(lambda self: self.d.get("trial"))  # what training it measured (finalists only)

    def key(self) -> tuple:
        c = self.config
        return (c["pp"], c["dp"], c["tp"], bool(c["sp"]), c["zero"], c["schedule"] if c["pp"] > 1 else "none",
                c["microbatches"] if c["pp"] > 1 else 1, c["vp"] if c["pp"] > 1 else 1, bool(c.get("recompute")))

    def describe(self) -> str:
        b, m = self.breakdown, self.memory
        parts = ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.2f}" for k, v in b.items() if v > 0)
        return (f"{self.label}: step {1e3 * self.step_s:.2f} ms ({parts} ms), {m['total'] / MiB:.1f} MiB per rank "
                f"(parameters {m['params'] / MiB:.1f}, gradients {m['grads'] / MiB:.1f}, optimizer "
                f"{m['optimizer'] / MiB:.1f}, activations {m['activations'] / MiB:.1f})")


@dataclass
class EagerPlan:
    """What ``generate_plan`` found: ``ranked`` (best first), ``rejected`` (with reasons),
    the profile, the collective model, the tensor-parallel choices and the timings."""

    model_class: str
    world: int
    batch: int
    ranked: list
    rejected: list
    profile: Profile
    comm: CommModel
    tp_choices: dict                  # (tp, sp) -> TPChoice
    seconds: dict = field(default_factory=dict)
    enumerated: int = 0
    constraints: dict = field(default_factory=dict)
    problem: dict = field(default_factory=dict)   # what the C++ search was given

    @property
    def best(self) -> EagerCandidate:
        if not self.ranked:
            reasons = sorted({c.verdict for c in self.rejected})
            raise PlanError(f"no plan for {self.model_class} fits the constraints {self.constraints}: "
                            + "; ".join(reasons[:5]))
        return self.ranked[0]

    def to_plan(self, candidate: EagerCandidate | None = None) -> Plan:
        return plan_for(candidate or self.best, self)

    def __str__(self) -> str:
        s = self.seconds
        lines = [f"vescale.generate_plan: {self.model_class} on {self.world} ranks ({self.comm.source}), batch "
                 f"{self.batch}; planned in {s.get('total', 0):.2f} s (profile {s.get('profile', 0):.2f}, collectives "
                 f"{s.get('comm', 0):.2f}, what-if {s.get('whatif', 0):.2f}, search {s.get('search', 0):.3f}); "
                 f"{self.enumerated} plans priced, {len(self.rejected)} refused"]
        if self.profile.derived:
            lines[0] += f"; not run here: times scaled from {self.profile.derived['from']}'s profile"
        if "trials" in s:
            lines[0] += f"; the {self._trained()} best predicted plans trained in {s['trials']:.2f} s"
        if self.ranked:
            best = self.best
            if best.trial is not None:
                lines.append(f"chosen by training the finalists: measured {1e3 * best.trial.step_s:.2f} ms per step "
                             f"(steps {', '.join(f'{1e3 * x:.1f}' for x in best.trial.steps_s)} ms)")
            lines.append(("chosen: " if best.trial is not None else "predicted best: ") + best.describe())
            per_rank = ", ".join(f"{m['total'] / MiB:.1f}" for m in self.best.rank_memory)
            lines.append(f"  memory per pipeline rank (MiB): {per_rank}")
            if len(self.ranked) > 1:
                lines.append("runners-up (why they lost):")
                for i, c in enumerate(self.ranked[1:8], 2):
                    lines.append(f"  #{i} {c.label:38s} {1e3 * c.step_s:8.2f} ms {c.memory['total'] / MiB:7.1f} MiB  "
                                 f"{c.verdict}")
        if self.rejected:
            lines.append("refused:")
            shown = {}
            for c in self.rejected:
                shown.setdefault(c.verdict, c.label)
            for verdict, label in list(shown.items())[:6]:
                lines.append(f"  {label}: {verdict}")
        for (tp, sp), ch in sorted(self.tp_choices.items()):
            if not sp:
                lines.append(ch.describe())
        return "\n".join(lines)

    __repr__ = __str__

    def _trained(self) -> int:
        return sum(c.trial is not None for c in self.ranked + self.rejected)


# ---- the plan ------------------------------------------------------------------------------------

def plan_for(c: EagerCandidate, result: EagerPlan) -> Plan:
    """A candidate as a ``vescale.Plan``."""
    cfg = c.config
    mesh = {name: size for name, size in (("PP", cfg["pp"]), ("DP", cfg["dp"]), ("TP", cfg["tp"])) if size > 1}
    if not mesh:
        mesh = {"DP": 1}
    settings = {"mesh": mesh, "data.global_batch_size": result.batch, "data_parallel.zero_stage": cfg["zero"]}
    if cfg["tp"] > 1:
        choice = result.tp_choices[(cfg["tp"], bool(cfg["sp"]))]
        settings["tensor_parallel.sharding_plan"] = choice.plan()
        settings["tensor_parallel.sequence_parallel"] = bool(cfg["sp"])
    if cfg.get("recompute"):  # every block checkpointed
        settings["recompute.modules"] = [re.escape(u.name) for u in result.profile.blocks_list]
    if cfg["pp"] > 1:
        blocks = [u.name for u in result.profile.blocks_list]
        starts = [sum(cfg["blocks_per_stage"][:s]) for s in range(1, len(cfg["blocks_per_stage"]))]
        settings.update({"pipeline_parallel.schedule": cfg["schedule"],
                         "pipeline_parallel.microbatches": cfg["microbatches"],
                         "pipeline_parallel.virtual_stages": cfg["vp"] if cfg["schedule"] == "interleaved_1f1b" else 1,
                         "pipeline_parallel.blocks": result.profile.blocks,
                         "pipeline_parallel.split_points": [blocks[i] for i in starts]})
    plan = Plan(settings)
    plan._report = result
    plan._candidate = c
    return plan


# ---- the inputs of the C++ search -----------------------------------------------------------------

def _schedules(world: int, batch: int, blocks: int) -> list[dict]:
    """Orders of every schedule, pipeline size and micro-batch count the search may try."""
    out = []
    for pp in range(2, world + 1):
        if world % pp:
            continue
        micro = sorted({m for dp in range(1, world // pp + 1) if (world // pp) % dp == 0 and batch % dp == 0
                        for m in range(1, batch // dp + 1) if (batch // dp) % m == 0})
        for name in SCHEDULES:
            vp = 2 if name in ("interleaved_1f1b", "zbv") else 1
            if pp * vp > blocks:
                continue
            for m in micro:
                try:
                    s = make_schedule(name, pp, m, vp)
                except ValueError:
                    continue
                out.append({"name": name, "pp": pp, "microbatches": m, "vp": vp, "placement": list(s.placement),
                            "orders": [[(a.kind, a.stage, a.mb) for a in order] for order in s.orders]})
    return out


def _comms(per_small: list, per_full: list, n1: int, n2: int) -> list:
    """Two event lists of one unit and phase (at n1 and n2 samples) as (kind, group, a, b)."""
    if len(per_small) != len(per_full):  # not the same collectives at both sizes: keep the full size's, flat
        return [(k, g, float(b), 0.0) for k, g, b in per_full]
    out = []
    for (k1, g1, b1), (k2, g2, b2) in zip(per_small, per_full):
        if (k1, g1) != (k2, g2):
            return [(k, g, float(b), 0.0) for k, g, b in per_full]
        slope = (b2 - b1) / (n2 - n1) if n2 != n1 else 0.0
        out.append((k2, g2, float(b2 - slope * n2), float(slope)))
    return out


def _layout_tp1(profile: Profile) -> dict:
    units = []
    for u in profile.units:
        units.append(dict(fwd=u.forward, bwd=u.backward, saved=u.saved, held=u.held_for_weights, out=u.out_bytes,
                          input_share=u.input_backward_share, split_cost=u.split_backward_cost, shadow=u.shadow_s,
                          param_bytes=float(u.param_bytes),
                          param_numel=float(u.param_numel), param_tensors=len(u.params), fwd_comm=[], bwd_comm=[]))
    return {"tp": 1, "sp": False, "units": units}


def _layout_sharded(profile: Profile, model, batch, tp: int, sp: bool, comm: CommModel, steps: int,
                    like: "EagerPlan | None" = None) -> tuple:
    """The layout of (tp, sp): sharding found by what-if runs, each unit's collectives at the
    two profiled batch sizes, its local compute timed at sharded shapes (or, for a profile
    derived from ``like``'s model, ``like``'s timings scaled; saved bytes from meta)."""
    choice = tensor_parallel_plan(profile, model, batch, tp, comm, sequence_parallel=sp)
    if not choice.feasible:
        return choice, None
    plan = choice.plan()
    n1, n2 = profile.measured_at
    real = choice.real_what_ifs
    at1 = choice.small_batch_collectives or unit_collectives(profile, model, slice_batch(batch, n1), plan, tp, sp,
                                                             real=real)
    choice.small_batch_collectives = None  # (not gathered with the choice)
    ev1, ev2 = at1.per_unit, unit_collectives(profile, model, slice_batch(batch, n2), plan, tp, sp, real=real).per_unit
    pb = at1.param_bytes
    working = None  # measured at the shards where they run here
    held = sharded_held_for_weights(profile, model, batch, plan, tp, real=real)
    if like is None:
        times = sharded_times(profile, model, batch, plan, tp, steps=steps)
        (f1, b1, s1, w1), (f2, b2, s2, w2) = times[n1], times[n2]
        if w1 is not None and w2 is not None:
            working = line_through(n1, w1, n2, w2)
        lines = {u.name: (line_through(n1, f1.get(u.name, 0.0), n2, f2.get(u.name, 0.0)),
                          line_through(n1, b1.get(u.name, 0.0), n2, b2.get(u.name, 0.0)),
                          line_through(n1, s1.get(u.name, 0), n2, s2.get(u.name, 0))) for u in profile.units}
    else:
        lines = scaled_sharded_lines(like.problem["layouts"], like.profile, profile, tp, sp,
                                     sharded_saved(profile, model, batch, plan, tp))
    units = []
    for u in profile.units:
        local = pb[u.name] / max(u.param_bytes, 1)
        out = tuple(x / tp for x in u.out_bytes) if sp else u.out_bytes
        fwd, bwd, saved = lines[u.name]
        units.append(dict(fwd=fwd, bwd=bwd, saved=saved, held=held.get(u.name, (0.0, 0.0)), out=out,
                          input_share=u.input_backward_share, split_cost=u.split_backward_cost,
                          shadow=u.shadow_s, param_bytes=float(pb[u.name]),
                          param_numel=float(u.param_numel * local), param_tensors=len(u.params),
                          partial_grad_bytes=float(at1.partial_bytes[u.name]),
                          fwd_comm=_comms(ev1[u.name]["forward"], ev2[u.name]["forward"], n1, n2),
                          bwd_comm=_comms(ev1[u.name]["backward"], ev2[u.name]["backward"], n1, n2)))
    layout = {"tp": tp, "sp": sp, "units": units}
    if working is not None:
        layout["working"] = working
    return choice, layout


def _collect(local: dict, world: int) -> dict:
    """Every rank's share of the layouts, gathered."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    out: dict = {}
    for g in gathered:
        out.update(g)
    return out


def plan_eager(model: nn.Module, sample_batch, *, world: int | None = None, constraints: dict | None = None,
               comm: CommModel | None = None, loss_fn=None, blocks: str | None = None, steps: int = 3,
               profile: Profile | None = None, tp_degrees=None, like: "EagerPlan | nn.Module | None" = None,
               trials: int | None = None) -> EagerPlan:
    """The planner's full answer (``generate_plan`` returns its best as a ``vescale.Plan``).
    ``like``: plan ``model`` without running it, from the planner's answer for a model of
    the same kinds of blocks that ran here (``vescale.autoplan.transfer``); a module is
    planned first (on ``sample_batch``). ``trials``: how many of the best predicted plans
    are trained on the ranks at hand to choose between them (``vescale.autoplan.trials``;
    default ``TRIALS``: none); only where the model runs here and the world is the ranks
    at hand. The caller's random state is left as it was."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):  # the profile and the trials draw (dropout, initialisation)
        return _plan_eager(model, sample_batch, world, constraints, comm, loss_fn, blocks, steps, profile, tp_degrees,
                           like, trials)


def _plan_eager(model, sample_batch, world, constraints, comm, loss_fn, blocks, steps, profile, tp_degrees, like,
                trials) -> EagerPlan:
    t0 = time.perf_counter()
    k = _check_constraints(constraints or {})
    running = dist.is_available() and dist.is_initialized()
    world = world or k.get("world_size") or (dist.get_world_size() if running else None)
    if world is None:
        raise PlanError("generate_plan needs the number of ranks: world=... or constraints['world_size']")
    if "world_size" in k and k["world_size"] != world:
        raise PlanError(f"planner constraint world_size is {k['world_size']} but world={world}")
    if running and dist.get_world_size() != world and comm is None:
        raise PlanError(f"generate_plan(world={world}) runs on {dist.get_world_size()} ranks: the collectives are "
                        f"measured on the ranks at hand; plan for them, or pass comm=CommModel(...)")
    for name in ("pp", "dp", "tp"):
        if name in k and world % k[name]:
            raise PlanError(f"planner constraint on {name.upper()} is {k[name]}, which does not divide the world "
                            f"of {world} ranks")
    if sample_batch is None:
        raise PlanError("generate_plan profiles the model on a sample batch: pass sample_batch=(inputs, targets) "
                        "or a dict of keyword arguments, as the model is called in training")
    batch = k.get("data.global_batch_size") or batch_size_of(sample_batch)
    seconds = {}
    if isinstance(like, nn.Module):
        like = plan_eager(like, sample_batch, world=world, comm=comm, loss_fn=loss_fn, steps=steps,
                          tp_degrees=tp_degrees)
        seconds["like"] = time.perf_counter() - t0
    if like is not None:
        if like.world != world:
            raise PlanError(f"generate_plan(like=...) was planned for {like.world} ranks, not {world}: its "
                            f"timings are those of {like.world} ranks sharing the machine")
        comm = comm or like.comm
    # 1. the profile
    t = time.perf_counter()
    if profile is None and like is None and any(p.is_meta for p in model.parameters()):
        raise PlanError(f"{type(model).__name__} lives on meta (no data): the planner cannot time it; pass "
                        f"like=<a smaller model of the same kinds of blocks that runs here> to plan it from that "
                        f"one's timings")
    if profile is None and like is not None:
        profile = profile_like(like.profile, model, sample_batch, loss_fn=loss_fn, blocks=blocks)
    profile = profile or profile_model(model, sample_batch, loss_fn=loss_fn, blocks=blocks, steps=steps)
    seconds["profile"] = time.perf_counter() - t
    # 2. the collectives
    t = time.perf_counter()
    if comm is None:  # up to the biggest gradient bucket a data-parallel plan reduces
        comm = measure_comm(world, largest=min(profile.param_bytes, _bucket_bytes()))
    seconds["comm"] = time.perf_counter() - t
    # 3. tensor-parallel layouts, shared among the ranks
    t = time.perf_counter()
    degrees = [d for d in (tp_degrees or range(2, world + 1)) if world % d == 0 and d > 1]
    if "tp" in k:
        degrees = [d for d in degrees if d == k["tp"]]
    sps = [bool(k["sp"])] if "sp" in k else [False, True]
    jobs = [(d, sp) for d in degrees for sp in sps]
    rank = dist.get_rank() if running else 0
    ranks = dist.get_world_size() if running else 1
    local = {}
    for i, (d, sp) in enumerate(jobs):
        if i % ranks != rank:
            continue
        try:
            choice, layout = _layout_sharded(profile, model, sample_batch, d, sp, comm, steps, like)
        except Exception as e:  # noqa: BLE001  (a degree the model cannot take: refused with the reason)
            choice, layout = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        local[(d, sp)] = (choice, layout)
    done = _collect(local, world)
    seconds["whatif"] = time.perf_counter() - t
    # 4. the search
    t = time.perf_counter()
    layouts = [_layout_tp1(profile)]
    tp_choices, tp_problems = {}, []
    for key in jobs:
        choice, layout = done[key]
        if isinstance(layout, dict):
            layouts.append(layout)
            tp_choices[key] = choice
        else:
            why = layout if isinstance(layout, str) else "; ".join(choice.problems) if choice else "failed"
            tp_problems.append(f"TP {key[0]}{' SP' if key[1] else ''}: {why}")
    units = []
    blocks_seen = 0
    for u in profile.units:
        cut = True
        if u.kind == "block":
            cut = blocks_seen == 0 or profile.legal_cuts[blocks_seen - 1]
            blocks_seen += 1
        units.append({"name": u.name, "kind": {"pre": 0, "block": 1, "post": 2}[u.kind],
                      "flops": u.flops[1], "params": float(u.param_numel), "cut_before": cut})
    tied = sum(_bytes_of(model, names[0]) for names in profile.tied
               if _spans_ends(profile, names))
    glue = sum(_bytes_of(model, n) for n in profile.glue_params)
    problem = {"units": units, "layouts": layouts, "comm": comm.as_rows(),
               "schedules": _schedules(world, batch, len(profile.blocks_list)), "world": world, "batch": batch,
               "optimizer_per_tensor": profile.optimizer[0], "optimizer_per_element": profile.optimizer[1],
               "glue_param_bytes": float(glue), "tied_param_bytes": float(tied),
               "grad_bytes_per_param_byte": 1.0, "cores": float(profile.cores),
               # ZeRO keeps an fp32 master slice only for parameters that are not fp32
               "master_bytes_per_element": 0.0 if profile.dtype_bytes == 4 else 4.0,
               "profiled_busy": profile.ranks if profile.cores else 1,
               "working_a": profile.working[0], "working_b": profile.working[1],
               "optimizer_temp_per_element": profile.optimizer_temp, "copy_per_byte": profile.copy_per_byte,
               "action_seconds": profile.action_s, "gather_copies": _gather_copies()}
    search = {key: k[key] for key in ("pp", "dp", "tp", "zero", "sp", "recompute", "microbatches", "vp", "schedule",
                                      "split", "memory_limit") if key in k}
    if running and ranks > 1:
        # Rank 0 searches and every rank takes its problem and answer. The inputs are agreed
        # (medians and maxima over the ranks), but a candidate at the memory limit's edge, or
        # two a last digit apart, must not split the ranks over arithmetic done per rank.
        box = [problem, _C.autoplan_eager_search(problem, search) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        problem, r = box
    else:
        r = _C.autoplan_eager_search(problem, search)
    seconds["search"] = time.perf_counter() - t
    ranked = [EagerCandidate(d) for d in r["ranked"]]
    rejected = [EagerCandidate(d) for d in r["rejected"]]
    for why in tp_problems:
        rejected.append(EagerCandidate({"config": {}, "label": why.split(":")[0], "verdict": why, "feasible": False,
                                        "step_s": 0.0, "memory": {}, "rank_memory": [], "breakdown": {},
                                        "bubble": 0.0}))
    answer = EagerPlan(type(model).__name__, world, batch, ranked, rejected, profile, comm, tp_choices, seconds,
                       r["enumerated"], dict(constraints or {}), problem)
    # 5. the finalists, trained on the ranks at hand
    here = running and ranks == world and like is None and not any(p.is_meta for p in model.parameters())
    picked = finalists(ranked, problem, TRIALS if trials is None else trials) if here else []
    if len(picked) > 1:
        t = time.perf_counter()
        measured = run_trials(answer, model, sample_batch, picked, loss_fn=loss_fn, steps=steps)
        answer.ranked, answer.rejected = ranked_by_trials(ranked, rejected, measured, problem,
                                                          k.get("memory_limit", 0.0))
        seconds["trials"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    return answer


def _bytes_of(model: nn.Module, name: str) -> int:
    p = model.get_parameter(name)
    return p.numel() * p.element_size()


def _bucket_bytes() -> int:
    """DDP's default bucket cap (the plan's data_parallel.bucket_cap_mb), in bytes."""
    return int(SCHEMA["data_parallel"]["bucket_cap_mb"][0] * 2**20)


def _gather_copies() -> float:
    """Whole copies of an all-gather's output the backend holds while it runs: gloo's
    all_gather_into_tensor gathers into a flat buffer of its own and copies out of it."""
    running = dist.is_available() and dist.is_initialized()
    return 1.0 if not running or dist.get_backend() == "gloo" else 0.0


def _spans_ends(profile: Profile, names: list[str]) -> bool:
    """A tied parameter held by a unit of the first stage and one of the last."""
    kinds = {u.kind for u in profile.units for n in names if n.startswith(u.name + ".")}
    return "pre" in kinds and "post" in kinds


def generate_plan(constraints: dict | nn.Module | None = None, model: nn.Module | dict | None = None, *,
                  sample_batch=None, world: int | None = None, comm: CommModel | None = None, loss_fn=None,
                  blocks: str | None = None, steps: int = 3, like: "EagerPlan | nn.Module | None" = None,
                  trials: int | None = None) -> Plan:
    """A ``vescale.Plan`` for ``model`` on ``world`` ranks, from the model's eager execution on
    ``sample_batch`` (one global batch, as the training loop calls the model) and
    measurements of the backend; ``constraints`` fix what they name (``CONSTRAINTS``).
    ``print(plan)`` shows the plan, the predicted step time and memory per rank and the
    runners-up with why they lost (``plan._report`` holds everything). Collective: every
    rank calls it when torch.distributed runs. ``comm``: a ``CommModel`` instead of
    measuring (e.g. planning in one process for other ranks). ``like``: a smaller model of
    the same kinds of blocks (or its ``plan_eager`` answer) that runs here: ``model`` is then
    planned without training it (it may live on ``meta``), its times scaled from the smaller
    one's by FLOPs, its memory and collectives from what-if runs of its own. ``trials``: how
    many of the best predicted plans are trained here before one is chosen (e.g. 4; by
    default none: the best predicted)."""
    if isinstance(constraints, nn.Module):  # generate_plan(model, constraints) as DESIGN.md writes it
        constraints, model = model, constraints
    if not isinstance(model, nn.Module):
        raise TypeError(f"generate_plan needs the model (an nn.Module), got {type(model).__name__}")
    result = plan_eager(model, sample_batch, world=world, constraints=constraints or {}, comm=comm,
                        loss_fn=loss_fn, blocks=blocks, steps=steps, like=like, trials=trials)
    return result.to_plan()
