"""What a candidate tensor-parallel plan costs per unit (embedding, block, head), read off
what-if runs over a virtual mesh (``virtual``): the collectives of each unit's forward and
backward and the bytes its parameters take on one rank (``unit_collectives``), the local
compute at the sharded shapes (``sharded_times``, on real tensors) and the bytes each unit
saves for backward (``sharded_saved``, on meta).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import _C
from ..dtensor import DTensor
from ..parallel.parallelize import parallelize_module
from ..parallel.pipeline.split import find_layout
from ..parallel.tp_grads import partial_gradients_of
from .calling import call_model, loss_of, slice_batch
from .profile import Profile
from .scalars import replays_profile
from .timing import median_times, saved_per_unit
from .virtual import Recorder, VirtualMesh, as_meta, meta_copy, what_if, what_if_batch, what_if_copy, what_if_run

__all__ = ["UnitCollectives", "unit_collectives", "sharded_times", "sharded_saved"]


# ---- collectives and memory per unit -------------------------------------------------------------

def _unit_hooks(model: nn.Module, profile: Profile, rec: Recorder, marks: dict):
    """Event counts at each unit's forward start / end and when its output gets a gradient."""
    handles = []
    for u in profile.units:
        mod = model.get_submodule(u.name)

        def pre(m, a, u=u):
            marks["fwd"].append((u.name, "pre", rec.count()))

        def post(m, a, out, u=u):
            marks["fwd"].append((u.name, "post", rec.count()))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point() and torch.is_grad_enabled():
                    t.register_hook(lambda g, n=u.name: marks["grad"].setdefault(n, rec.count()) and None)
                    break
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def _split_events(events: list, marks: dict, forward_end: int, units: list[str]) -> dict:
    """Events per unit and phase: forward events between a unit's start and end (glue
    before a unit goes to it, after the last to the last); backward events from when its
    output gets a gradient to when the next unit's does."""
    per = {u: {"forward": [], "backward": []} for u in units}
    last_end, depth, owner = 0, 0, None
    pending = 0
    for name, kind, count in marks["fwd"]:
        if kind == "pre":
            if depth == 0:
                pending = last_end
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                per[name]["forward"] += events[pending:count]
                last_end, owner = count, name
    if owner is not None:
        per[owner]["forward"] += events[last_end:forward_end]
    grads = sorted(marks["grad"].items(), key=lambda kv: kv[1])
    for i, (name, count) in enumerate(grads):
        end = grads[i + 1][1] if i + 1 < len(grads) else len(events)
        start = forward_end if i == 0 else count
        per[name]["backward"] += events[start:end]
    return per


@dataclass
class UnitCollectives:
    per_unit: dict       # unit -> {"forward": events, "backward": events}, events (kind, group size, bytes)
    param_bytes: dict    # unit -> bytes of its parameters one TP rank holds
    partial_bytes: dict  # unit -> of those, the bytes whose gradients arrive Partial (reduced by tp_grads)
    events: list         # all of them, in order


@replays_profile
def unit_collectives(profile: Profile, model: nn.Module, batch, plan: dict, tp: int, sequence_parallel: bool, *,
                     real: bool = False):
    """Runs the whole model with ``plan`` over a virtual TP mesh (on meta, or on real local
    tensors: ``real``): per unit, the collectives of its forward and backward [(kind, group
    size, bytes)], and the bytes of its parameters one TP rank holds, and of those whose
    gradients are Partial sums."""
    meta = what_if_copy(model, real)  # parallelize_module changes it
    mesh = VirtualMesh([tp], ["TP"])
    with what_if_run(real):
        parallelize_module(meta, mesh, plan)
        marks = {"fwd": [], "grad": {}}
        with Recorder() as rec:
            handles = _unit_hooks(meta, profile, rec, marks)
            try:
                loss = loss_of(call_model(meta, what_if_batch(batch, real)))
                forward_end = rec.count()
                loss.backward()
            finally:
                for h in handles:
                    h.remove()
    marks = {"fwd": [(n, k, rec.position(c)) for n, k, c in marks["fwd"]],
             "grad": {n: rec.position(c) for n, c in marks["grad"].items()}}
    per = _split_events(rec.events, marks, rec.position(forward_end), [u.name for u in profile.units])
    partial = {id(p) for r in partial_gradients_of(meta) for p in r.last_reduced}
    param_bytes, partial_bytes = {}, {}
    seen = set()
    for u in profile.units:
        param_bytes[u.name] = partial_bytes[u.name] = 0
        for p in meta.get_submodule(u.name).parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = _C.local_tensor(p) if isinstance(p, DTensor) else p
            param_bytes[u.name] += local.numel() * local.element_size()
            if id(p) in partial:
                partial_bytes[u.name] += local.numel() * local.element_size()
    return UnitCollectives(per, param_bytes, partial_bytes, rec.events)


# ---- local compute at sharded shapes -------------------------------------------------------------

def sharded_times(profile: Profile, model: nn.Module, batch, plan: dict, tp: int, *, steps: int = 3,
                  batch_sizes=None) -> dict:
    """Forward and backward seconds per unit of one TP rank (coordinate 0) running the model
    sharded by ``plan`` on real local tensors over a virtual mesh: the compute at sharded
    shapes and the dispatcher's work, without the collectives' time, and the bytes each
    unit saves for backward on that rank. Returns {batch size: (forward per unit, backward
    per unit, saved bytes per unit, the forward + backward's peak beyond the gradients)}."""

    real = copy.deepcopy(model)
    mesh = VirtualMesh([tp], ["TP"])
    batch_sizes = batch_sizes or profile.measured_at
    out = {}
    with what_if_run(real=True):
        parallelize_module(real, mesh, plan)
        layout = find_layout(real, profile.blocks)
        for n in batch_sizes:
            # processor time at the profile's contention: the ranks time different
            # layouts at once, and one that finishes first leaves the cores to the others
            working: dict = {}
            f, b, _, _, _ = median_times(real, layout, slice_batch(batch, n), None, steps,
                                          wall_per_cpu=profile.wall_per_cpu, working=working)
            out[n] = (f, b, saved_per_unit(real, layout, slice_batch(batch, n)), working.get(n))
    return out


@replays_profile
def sharded_saved(profile: Profile, model: nn.Module, batch, plan: dict, tp: int, batch_sizes=None) -> dict:
    """The bytes each unit saves for backward on one TP rank under ``plan``, from a what-if
    run on meta (no data, no compute): {batch size: saved bytes per unit}."""

    meta = meta_copy(model)
    mesh = VirtualMesh([tp], ["TP"])
    out = {}
    with what_if():
        parallelize_module(meta, mesh, plan)
        layout = find_layout(meta, profile.blocks)
        for n in batch_sizes or profile.measured_at:
            out[n] = saved_per_unit(meta, layout, tree_map(as_meta, slice_batch(batch, n)))
    return out
