"""Profile model A, plan model B: the planner's view of a model that never runs here.

A model too big for one rank cannot be profiled by training it. What the planner needs
from it splits in two:

- what follows from shapes alone (the units and their parameters, what each saves for
  backward and hands on, its FLOPs and ops, the legal cuts, the collectives and bytes of
  every tensor-parallel layout): read off model B itself, on ``meta`` tensors, through
  the same hooks, dispatch modes and what-if runs as a measured profile;
- what takes a clock or an allocator (forward and backward seconds, unsharded and per
  tensor-parallel layout, the backward's input/weight split, the shadows' cost, the
  optimizer's and the copies' rates, the transients of a step beyond what is saved,
  scaled like the head's saved bytes): taken from a planner's answer
  for model A, which did run here, unit by unit. A block of B takes the median times of
  A's blocks of its class, a unit before or after the blocks those of A's unit of the same
  name (else kind and class); the per-sample part scaled by the ratio of their FLOPs (of
  their output bytes for units without FLOPs, e.g. an embedding), the fixed part
  (per-call overhead: dispatch, kernel launches) A's as it is.

A deeper B (more blocks of A's kind) scales exactly; a wider one as far as time follows
FLOPs (bench/autoplan.py --transfer measures how far). Model A must hold every kind of
unit B does, and A's planner answer must include each tensor-parallel degree B is to be
planned at.
"""

from __future__ import annotations

import statistics
import time

import torch.nn as nn
from torch.utils._pytree import tree_map

from ..parallel.pipeline.split import find_layout
from ..plan import PlanError
from .calling import batch_size_of, slice_batch
from .profile import Profile, UnitProfile, assemble_units, second_batch_size, structure_fields, unit_kind
from .structure import linears_of, signature, untimed_step
from .timing import Timer, held_for_weights_if_splittable, line_through, saved_per_unit
from .scalars import replaying
from .virtual import as_meta, meta_copy, what_if

__all__ = ["profile_like", "scaled_sharded_lines"]


def _counterparts(name: str, kind: str, cls: str, source: Profile) -> list[UnitProfile]:
    """The units of ``source`` whose times a unit of the planned model takes: a block takes
    the median of all of the source's blocks of its class (they are the same computation:
    the median damps a block timed while the machine was busy); a unit before or after
    the blocks takes the one of its name, else the first of its kind and class."""
    same = [u for u in source.units if u.kind == kind and u.cls == cls]
    if kind != "block":
        same = [u for u in same if u.name == name] or same[:1]
    if not same:
        have = sorted({f"{u.kind} {u.cls}" for u in source.units})
        raise PlanError(f"the model to plan has a {kind} unit {name!r} of class {cls}, which the profiled model "
                        f"({source.model_class}) does not have (it has {have}): profile a smaller model made of "
                        f"the same kinds of modules")
    return same


def _median_line(lines: list) -> tuple:
    return (statistics.median(a for a, _ in lines), statistics.median(b for _, b in lines))


def _ratio(flops: float, out: float, a: UnitProfile) -> float:
    """How much more compute a unit does per sample than its counterpart ``a`` (the source's
    blocks of one class have equal FLOPs: any one of them will do)."""
    if flops > 0 and a.flops[1] > 0:
        return flops / a.flops[1]
    if out > 0 and a.out_bytes[1] > 0:
        return out / a.out_bytes[1]
    return 1.0


def _output_bytes(model: nn.Module, layout, batch, loss_fn) -> dict:
    timer = Timer(layout)
    try:
        timer.step(model, batch, loss_fn)
    finally:
        timer.remove()
    model.zero_grad(set_to_none=True)
    return dict(timer.out_bytes)


def _scaled(line: tuple, r: float) -> tuple:
    return (line[0], line[1] * r)


def profile_like(source: Profile, model: nn.Module, sample_batch, *, loss_fn=None,
                 blocks: str | None = None) -> Profile:
    """A ``Profile`` of ``model`` (B) without running it: shapes, memory and FLOPs from a run
    on meta tensors, times from ``source`` (the measured profile of a model A of the same
    kinds of units) scaled unit by unit (see the module docstring). ``model`` may be a
    real or a meta model; it is left as it is."""
    start = time.perf_counter()
    meta = meta_copy(model)
    layout = find_layout(meta, blocks)
    B = batch_size_of(sample_batch)
    small = second_batch_size(B)
    full = tree_map(as_meta, sample_batch)
    part = slice_batch(full, small)
    linears = linears_of(meta)
    with replaying(source.scalars), what_if():
        st = untimed_step(meta, layout, full, loss_fn, linears)
        saved_small = saved_per_unit(meta, layout, part, loss_fn)
        held_small = held_for_weights_if_splittable(meta, layout, part, loss_fn)
        out = [_output_bytes(meta, layout, b, loss_fn) for b in (part, full)]
    match: dict = {}
    for u in layout.units:
        same = _counterparts(u.name, unit_kind(u), type(u.module).__name__, source)
        per_sample_out = line_through(small, out[0].get(u.name, 0), B, out[1].get(u.name, 0))[1]
        match[u.name] = (same, _ratio(st["flops"].get(u.name, 0.0) / B, per_sample_out, same[0]))
    at = {}
    for what in ("forward", "backward"):
        lines = {n: _scaled(_median_line([getattr(a, what) for a in same]), r) for n, (same, r) in match.items()}
        at[what] = tuple({n: ln[0] + ln[1] * size for n, ln in lines.items()} for size in (small, B))
    shares, split_costs = {}, {}
    for u in layout.blocks:
        same, _ = match[u.name]
        sig = signature(u.module)
        shares.setdefault(sig, same[0].input_backward_share)
        split_costs.setdefault(sig, same[0].split_backward_cost)
    shadows = {n: statistics.median(a.shadow_s for a in same) for n, (same, _) in match.items()}
    units = assemble_units(meta, layout, st, (small, B), at["forward"], at["backward"], (saved_small, st["saved"]),
                           tuple(out), shares, split_costs, shadows, (small, held_small))

    # the profile's working memory is the peak of a forward + backward (the backward's less
    # the gradients), which comes at the forward's end: all that is saved, plus transients
    # (the logits and their gradient): A's transients, scaled like the head's saved bytes
    fields = structure_fields(meta, layout, st, linears)

    def saved_total(p_units, n, kinds=("pre", "block", "post")):
        return sum(u.at("saved", n) for u in p_units if u.kind in kinds)
    working = []
    for n in (small, B):
        transient = max(0.0, source.working[0] + source.working[1] * n - saved_total(source.units, n))
        head_a, head_b = saved_total(source.units, n, ("post",)), saved_total(units, n, ("post",))
        transient *= head_b / head_a if head_a > 0 else 1.0
        working.append(saved_total(units, n) + transient)
    totals = {what: [sum(u.at(what, n) for u in units) for n in (small, B)] for what in ("forward", "backward")}
    return Profile(
        units=units, **fields, batch=B, measured_at=(small, B),
        step=dict(forward_s=totals["forward"][1], backward_s=totals["backward"][1],
                  forward_small_s=totals["forward"][0], backward_small_s=totals["backward"][0]),
        optimizer=source.optimizer, seconds=time.perf_counter() - start, ranks=source.ranks, cores=source.cores,
        working=line_through(small, working[0], B, working[1]), optimizer_temp=source.optimizer_temp,
        copy_per_byte=source.copy_per_byte, action_s=source.action_s, scalars=source.scalars,
        derived={"from": source.model_class,
                 "units": {n: ([a.name for a in same], r) for n, (same, r) in match.items()}})


def scaled_sharded_lines(source_layouts: list, source: Profile, profile: Profile, tp: int, sp: bool,
                         saved: dict) -> dict:
    """Per unit of ``profile`` (derived by ``profile_like`` from ``source``): forward and
    backward lines of one TP rank, from the source's layout of (tp, sp) scaled like the
    unsharded ones, and the saved bytes of the what-if run (``saved``: {batch size: bytes
    per unit}). Raises PlanError when the source was not planned at that layout."""
    layout = next((x for x in source_layouts if x["tp"] == tp and bool(x["sp"]) == bool(sp)), None)
    if layout is None:
        raise PlanError(f"the profiled model ({source.model_class}) has no timings at TP {tp}{' SP' if sp else ''}: "
                        f"plan it with that degree too")
    index = {u.name: i for i, u in enumerate(source.units)}
    n1, n2 = profile.measured_at
    out = {}
    for u in profile.units:
        names, r = profile.derived["units"][u.name]
        las = [layout["units"][index[n]] for n in names]
        out[u.name] = (_scaled(_median_line([la["fwd"] for la in las]), r),
                       _scaled(_median_line([la["bwd"] for la in las]), r),
                       line_through(n1, saved[n1].get(u.name, 0), n2, saved[n2].get(u.name, 0)))
    return out
