"""Pipeline schedules: for every pipeline rank, the order in which it runs forwards and
backwards of its stages on the micro-batches.

An order is a list of ``Action``s. ``F`` is a forward, ``B`` a whole backward, ``I`` and
``W`` the two halves of a split backward (gradient of the stage input, then of the
weights; zero-bubble schedules move ``W`` into what would be idle time). Orders are
plain data, made once per (schedule, ranks, micro-batches) and checked by ``simulate``,
which also gives the idle fraction that the benchmark compares with the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ... import _C

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


@dataclass(frozen=True)
class Action:
    kind: str   # "F", "B", "I" or "W"
    stage: int  # the global stage index
    mb: int     # the micro-batch

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Schedule:
    name: str
    ranks: int           # pipeline ranks
    stages: int          # stages in all (ranks x virtual stages per rank)
    microbatches: int
    orders: tuple        # orders[rank] = tuple of Actions
    placement: tuple     # placement[stage] = the rank that runs it

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    @property
    def splits_backward(self) -> bool:
        return any(a.kind == "I" for order in self.orders for a in order)


def make_schedule(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The orders of schedule ``name`` for ``ranks`` pipeline ranks and ``microbatches``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    if microbatches < 1:
        raise ValueError(f"the number of micro-batches must be at least 1, got {microbatches}")
    if name == "zbv":
        if virtual_stages not in (1, 2):
            raise ValueError("schedule 'zbv' runs two stages per rank (virtual_stages=2)")
        placement = tuple(list(range(ranks)) + list(range(ranks - 1, -1, -1)))
        sched = Schedule(name, ranks, 2 * ranks, microbatches, _zbv(ranks, microbatches), placement)
        simulate(sched)
        return sched
    if virtual_stages != 1 and name != "interleaved_1f1b":
        raise ValueError(f"schedule {name!r} runs one stage per rank; virtual_stages={virtual_stages} needs "
                         f"schedule='interleaved_1f1b'")
    if name == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError("schedule 'interleaved_1f1b' needs virtual_stages >= 2 (stages per rank); "
                             "with one stage per rank use '1f1b'")
        if microbatches % ranks:
            raise ValueError(f"interleaved 1F1B runs micro-batches in rounds of the pipeline size: "
                             f"microbatches={microbatches} must be a multiple of {ranks}")
        orders = [_interleaved(r, ranks, microbatches, virtual_stages) for r in range(ranks)]
    else:
        make: Callable = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb_h1": _zb_h1}[name]
        orders = [make(r, ranks, microbatches) for r in range(ranks)]
    stages = ranks * virtual_stages
    sched = Schedule(name, ranks, stages, microbatches, tuple(tuple(o) for o in orders),
                     tuple(s % ranks for s in range(stages)))
    simulate(sched)  # every order must be runnable: a wrong one would hang the ranks
    return sched


def _gpipe(rank: int, p: int, m: int) -> list[Action]:
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", rank, warmup + i), Action("B", rank, i)]
    return order + [Action("B", rank, i) for i in range(m - warmup, m)]


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches in rounds of p, each round through every
    virtual stage of the rank before the next round starts."""
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", ((k // p) % v) * p + rank, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        return Action("B", (v - 1 - (k // p) % v) * p + rank, (k // (p * v)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    return order + [backward(k) for k in range(total - warmup, total)]


def _zb_h1(rank: int, p: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split
    in I and W. Rank r runs 1F1B's warm-up, then F, I and the oldest waiting W in turn, but
    holds back its first r W's (the last rank p - 1 of them): the I's, which the previous
    rank waits for, go first, and the held-back W's fill the cool-down bubble."""
    warmup = min(p - rank - 1, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    next_i = next_w = 0
    for k in range(m):  # one I per step; after the last forward, only I's (and W's)
        if warmup + k < m:
            order.append(Action("F", rank, warmup + k))
        order.append(Action("I", rank, next_i))
        next_i += 1
        if k >= rank:
            order.append(Action("W", rank, next_w))
            next_w += 1
    return order + [Action("W", rank, i) for i in range(next_w, m)]


def _zbv(p: int, m: int) -> tuple:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory"): two stages per
    rank in a V, stage s on rank s for s < p and on rank 2p - 1 - s after, so the first and
    the last stage (embedding and head, often tied) share rank 0, with the backward split
    in I and W. Built on a unit-time clock: each rank takes an I when one is ready (the
    stage before waits for it), else an F (the second stage of the V first: it leads to
    the loss) while it holds at most 2p micro-batch stages, as 1F1B's first rank does,
    else a W, which fills what would be idle time."""
    S = 2 * p
    rank = list(range(p)) + list(range(p - 1, -1, -1))
    done: set = set()
    nf, ni, nw = [0] * S, [0] * S, [0] * S
    orders: list[list[Action]] = [[] for _ in range(p)]
    while any(nw[s] < m for s in range(S)):
        chosen = []
        for r in range(p):
            mine = [s for s in range(S) if rank[s] == r]
            held = sum(nf[s] - nw[s] for s in mine)
            i_ready = [s for s in mine if ni[s] < nf[s] and (s == S - 1 or ("I", s + 1, ni[s]) in done)]
            f_ready = [s for s in mine if nf[s] < m and (s == 0 or ("F", s - 1, nf[s]) in done)]
            w_ready = [s for s in mine if nw[s] < ni[s]]
            if i_ready:
                s = min(i_ready, key=lambda s: (ni[s], -s))
                kind = "I"
            elif f_ready and held < 2 * p:
                s, kind = max(f_ready), "F"
            elif w_ready:
                s = min(w_ready, key=lambda s: (nw[s], -s))
                kind = "W"
            else:
                continue
            counter = {"F": nf, "I": ni, "W": nw}[kind]
            chosen.append((kind, s, counter[s], r))
            counter[s] += 1
        for kind, s, mb, r in chosen:  # finish together: visible at the next tick
            done.add((kind, s, mb))
            orders[r].append(Action(kind, s, mb))
    return tuple(tuple(o) for o in orders)


# ---- checking and timing ---------------------------------------------------------------------

DURATIONS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def simulate(sched: Schedule, durations: dict | None = None, *, stage_costs: list | None = None,
             send_forward: list | None = None, send_backward: list | None = None) -> dict:
    """Runs the orders on a clock (the C++ simulator, autoplan/pipeline_sim.h): every rank
    takes its next action as soon as it is free and what it depends on has arrived.
    Raises if the orders cannot all finish (they would hang) or miss an action.

    Costs: ``durations`` per kind (``DURATIONS``: F = I = W = 1, B = 2) for every stage, or
    ``stage_costs``, one ``(F, B, I, W)`` in seconds per stage; ``send_forward`` /
    ``send_backward``: per stage boundary, the time an activation / gradient takes to
    reach another rank (free by default). Returns the makespan, the idle fraction of the
    pipeline (the bubble), (p * makespan - busy) / (p * makespan), the busy time per rank
    and the timeline, ``(kind, stage, mb, rank, start, end)`` per action."""
    if stage_costs is None:
        d = {**DURATIONS, **(durations or {})}
        stage_costs = [(d["F"], d["B"], d["I"], d["W"])] * sched.stages
    orders = [[(a.kind, a.stage, a.mb) for a in order] for order in sched.orders]
    return _C.simulate_pipeline(sched.name, orders, list(sched.placement), sched.microbatches,
                                [tuple(float(x) for x in c) for c in stage_costs], list(send_forward or []),
                                list(send_backward or []))


def analytic_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook idle fraction with F = I = W (B = 2F) and free communication."""
    if name in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":  # (p - 1)(F + I - W) idle per rank against 3m busy
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(name)
