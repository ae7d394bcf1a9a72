"""Profiling an unmodified model from real eager execution: the planner's view of it.

``profile_model(model, sample_batch)`` runs a few training steps (forward, backward) of
the model as it is, on this rank, and records through module hooks, tensor gradient
hooks, ``saved_tensors_hooks`` and one pass under a dispatch mode (never a graph or a
trace of the model):

- the module tree in execution order (depth, class, parameters), and which aten ops
  each module's forward runs (and the backward's ops, in all);
- the *units* the planner places: the repeated blocks (children of the model's list of
  blocks, ``vescale.parallel.pipeline.split.find_layout``), the units before them
  (embeddings) and after them (final norm, head); per unit: forward and backward time,
  the input- / weight-gradient share of the backward (blocks, measured by the split
  that zero-bubble schedules run), bytes saved for backward, parameter bytes, forward
  FLOPs, the bytes of what it hands on (a pipeline send), and the inputs it takes from
  outside the chain (masks, rotary tables, ...);
- the legal pipeline cuts: a cut before block i is legal when every tensor block i
  receives that needs a gradient is block i-1's output (the rest is recomputable glue);
- linear layers whose output the model splits into k equal pieces right away (fused
  q|k|v or gate|up): the tensor-parallel what-if tries ``InterleavedShard`` on them;
- the optimizer step's time per element and per tensor (AdamW on copies), and the
  pipeline runtime's own processor time per schedule action (``runtime_cost``).

Times and byte counts are taken at two batch sizes and kept as ``a + b * n`` in the
number of samples n, so the cost model can ask for any micro-batch size. When ranks are
initialised, every rank profiles at once (so the times include the contention of ranks
sharing the machine, as in a real step) and the medians are averaged over the ranks.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..parallel.pipeline.split import Layout, find_layout
from .calling import batch_size_of, call_model, loss_of, slice_batch
from .runtime_cost import action_seconds
from .scalars import ScalarTape
from .structure import Linear, linears_of, signature, untimed_step
from .timing import (copy_seconds_per_byte, held_for_weights_if_splittable, input_share, line_through, median_times,
                     meta_forward_times, optimizer_times, saved_per_unit)

__all__ = ["Linear", "UnitProfile", "Profile", "profile_model", "call_model", "loss_of", "slice_batch",
           "batch_size_of"]


@dataclass
class UnitProfile:
    name: str
    kind: str                    # "pre", "block" or "post"
    index: int | None            # block index
    cls: str
    signature: tuple             # class and parameter shapes: blocks with equal signatures are one cluster
    param_bytes: int
    param_numel: int
    params: list[str]
    forward: tuple = (0.0, 0.0)  # seconds = a + b * samples
    backward: tuple = (0.0, 0.0)
    input_backward_share: float = 0.5  # of the backward: the input-gradient half (I), the rest W
    split_backward_cost: float = 1.0   # (I + W) / a plain backward: what splitting the backward costs
    shadow_s: float = 0.0              # its forward on meta (a pipeline stage that does not own it runs that)
    saved: tuple = (0.0, 0.0)    # bytes saved for backward
    held_for_weights: tuple = (0.0, 0.0)  # bytes a split backward keeps from I to W (split_backward.py)
    out_bytes: tuple = (0.0, 0.0)  # bytes of the outputs that need a gradient (what a pipeline sends on)
    flops: tuple = (0.0, 0.0)    # forward FLOPs
    ops: dict = field(default_factory=dict)  # aten op -> calls in its forward (one step)
    side_inputs: list = field(default_factory=list)  # inputs from outside the chain, e.g. "attention_mask"

    def at(self, what: str, n: float) -> float:
        a, b = getattr(self, what)
        return a + b * n


@dataclass
class Profile:
    model_class: str
    blocks: str                    # FQN of the list of blocks
    units: list[UnitProfile]
    modules: list[tuple]           # (FQN, depth, class) in the order their forwards first ran
    glue_params: list[str]         # parameters outside every unit (every pipeline stage holds them)
    tied: list[list[str]]          # parameters that are one tensor under several names
    linears: list[Linear]
    legal_cuts: list[bool]         # per block i >= 1: may a stage start there
    cut_problems: list[str]
    batch: int                     # samples of the sample batch
    measured_at: tuple             # the two batch sizes timed
    step: dict                     # totals at the full batch: forward_s, backward_s
    optimizer: tuple               # AdamW step seconds = a * tensors + b * elements
    backward_ops: dict             # aten op -> calls during one backward
    param_bytes: int
    dtype_bytes: int
    seconds: float = 0.0           # how long profiling took
    ranks: int = 1                 # how many ranks profiled at once (and averaged their timings)
    cores: float = 0.0             # processors the ranks effectively share (0: one each)
    # bytes a forward + backward adds at its peak (a + b n): at the forward's end all of it,
    # in the backward beyond the gradients it makes
    working: tuple = (0.0, 0.0)
    optimizer_temp: float = 0.0    # bytes the optimizer step adds at its peak, per parameter element
    copy_per_byte: float = 0.0     # seconds per byte of a tensor copy (DDP buckets, ZeRO slices)
    action_s: float = 0.0          # processor seconds of the pipeline runtime per schedule action
    wall_per_cpu: float = 1.0      # wall seconds per processor second of the profiled steps (the ranks' contention)
    # values the model read out of its tensors, per place in its code (vescale.autoplan.scalars)
    scalars: dict = field(default_factory=dict)
    # set by vescale.autoplan.transfer.profile_like: not measured on this model but scaled
    # from another's, {"from": its class, "units": {unit: (the other's units, compute ratio)}}
    derived: dict = field(default_factory=dict)

    @property
    def blocks_list(self) -> list[UnitProfile]:
        return [u for u in self.units if u.kind == "block"]

    def unit(self, name: str) -> UnitProfile:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    def clusters(self) -> list[list[UnitProfile]]:
        """Blocks with equal signatures (class and parameter shapes), in order of first appearance."""
        groups: dict = {}
        for u in self.blocks_list:
            groups.setdefault(u.signature, []).append(u)
        return list(groups.values())

    def summary(self) -> str:
        lines = [f"profile of {self.model_class}: {len(self.blocks_list)} blocks in {self.blocks!r}"
                 f"{f', ranks share {self.cores:.2f} cores' if self.cores else ''}, "
                 f"{self.param_bytes / 2**20:.2f} MiB of parameters, batch {self.batch} (timed at "
                 f"{self.measured_at[0]} and {self.measured_at[1]} samples, {self.ranks} rank(s)), "
                 f"forward {1e3 * self.step['forward_s']:.2f} ms, backward {1e3 * self.step['backward_s']:.2f} ms, "
                 f"pipeline runtime {1e3 * self.action_s:.2f} ms per schedule action, profiled in {self.seconds:.2f} s"]
        if self.derived:
            lines[0] += (f"; times scaled from {self.derived['from']}'s by FLOPs (sizes, memory and collectives "
                         f"from what-if runs of this model on meta)")
        n = self.batch
        for u in self.units:
            lines.append(f"  {u.kind:5s} {u.name:40s} fwd {1e3 * u.at('forward', n):7.3f} ms  bwd "
                         f"{1e3 * u.at('backward', n):7.3f} ms  saved {u.at('saved', n) / 2**20:7.2f} MiB  params "
                         f"{u.param_bytes / 2**20:6.2f} MiB  GFLOP {u.at('flops', n) / 1e9:6.3f}")
        bad = [f"{self.blocks_list[i + 1].name}: {p}" for i, p in enumerate(self.cut_problems) if p]
        if bad:
            lines.append("  cuts that are not legal: " + "; ".join(bad))
        fused = [f"{lin.name} (x{lin.fused})" for lin in self.linears if lin.fused > 1]
        if fused:
            lines.append("  fused outputs split by the model: " + ", ".join(fused))
        return "\n".join(lines)


# The second batch size timed: the smallest micro-batch the search may choose that is not
# degenerate. Per-call costs (Python, kernel launches, small matrices running below the
# machine's speed) weigh most at small sizes, so a line through it and the whole batch is
# close over the range the search uses; a batch dim of 1 is left out because views and
# sharding rules take shortcuts on a dim of size 1 (the GPT's loss under sequence
# parallelism redistributes with an all-to-all at 1 sample, an all-gather from 2 on).
def second_batch_size(batch: int) -> int:
    return 2 if batch > 2 else 1


def profile_model(model: nn.Module, sample_batch, *, loss_fn=None, blocks: str | None = None, steps: int = 3,
                  small: int | None = None, average_over_ranks: bool = True) -> Profile:
    """Profiles ``model`` training on ``sample_batch`` (a batch as ``vescale.parallelize``'s
    model takes it: a dict of keyword arguments, a tuple of positional ones, or a tensor;
    the model must return its loss, or an output with ``.loss``; else pass ``loss_fn``).

    The model's parameters and gradients are left as they were. ``small``: the second
    batch size timed (default: ``second_batch_size``)."""
    start = time.perf_counter()
    layout = find_layout(model, blocks)
    B = batch_size_of(sample_batch)
    small = small or second_batch_size(B)
    was_training = model.training
    model.train()
    saved_grads = {id(p): p.grad for p in model.parameters()}
    linears = linears_of(model)
    try:
        small_batch = slice_batch(sample_batch, small)
        st = untimed_step(model, layout, sample_batch, loss_fn, linears)
        saved_small = saved_per_unit(model, layout, small_batch, loss_fn)
        held_small = held_for_weights_if_splittable(model, layout, small_batch, loss_fn)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the ranks time together, as they will train
        ratios: list[float] = []
        working: dict = {}
        f2, b2, tf2, tb2, out2 = median_times(model, layout, sample_batch, loss_fn, steps, ratios=ratios,
                                               working=working)
        f1, b1, tf1, tb1, out1 = median_times(model, layout, small_batch, loss_fn, steps, ratios=ratios,
                                               working=working)
        wall_per_cpu = statistics.median(ratios)
        # the input-gradient share of each block cluster's backward, and the split's cost
        shares: dict = {}
        split_costs: dict = {}
        with ScalarTape() as tape:  # what the what-if runs on meta will need to be told
            block_inputs = _capture_block_inputs(model, layout, small_batch, loss_fn)
        for u in layout.blocks:
            sig = signature(u.module)
            if sig not in shares and u.block in block_inputs:
                try:
                    shares[sig], split_costs[sig] = input_share(u.module, block_inputs[u.block])
                except RuntimeError:  # a block torch's split backward cannot take apart: half and half
                    shares[sig], split_costs[sig] = 0.5, 1.0
        opt, opt_temp = optimizer_times(model)
        copy_s = copy_seconds_per_byte()
        action_s = action_seconds() if average_over_ranks else 0.0
        shadows = meta_forward_times(model, layout, small_batch, loss_fn)
    finally:
        for p in model.parameters():
            p.grad = saved_grads.get(id(p))
        model.train(was_training)

    ranks = 1
    if average_over_ranks and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = dist.get_world_size()
        names = [u.name for u in layout.units]
        vec = [f1.get(n, 0.0) for n in names] + [f2.get(n, 0.0) for n in names] + \
              [b1.get(n, 0.0) for n in names] + [b2.get(n, 0.0) for n in names] + \
              [tf1, tf2, tb1, tb2, opt[0], opt[1], copy_s] + list(shares.values()) + list(split_costs.values()) + \
              [shadows.get(n, 0.0) for n in names] + [wall_per_cpu]
        # host memory in use (glibc's counters) differs between ranks by what each process
        # happened to allocate: the ranks take the largest, the cautious reading
        held = [working.get(small, 0.0), working.get(B, 0.0), opt_temp]
        gathered = [None] * ranks  # the median over ranks: one rank descheduled for a while does not count
        dist.all_gather_object(gathered, (vec, held))
        v = [statistics.median(col) for col in zip(*(g[0] for g in gathered))]
        working_small, working_b, opt_temp = (max(col) for col in zip(*(g[1] for g in gathered)))
        working = {small: working_small, B: working_b}
        k = len(names)
        f1, f2 = dict(zip(names, v[:k])), dict(zip(names, v[k:2 * k]))
        b1, b2 = dict(zip(names, v[2 * k:3 * k])), dict(zip(names, v[3 * k:4 * k]))
        tf1, tf2, tb1, tb2 = v[4 * k:4 * k + 4]
        opt = (v[4 * k + 4], v[4 * k + 5])
        copy_s = v[4 * k + 6]
        ns = len(shares)
        shares = dict(zip(shares.keys(), v[4 * k + 7:4 * k + 7 + ns]))
        split_costs = dict(zip(split_costs.keys(), v[4 * k + 7 + ns:4 * k + 7 + 2 * ns]))
        shadows = dict(zip(names, v[4 * k + 7 + 2 * ns:-1]))
        wall_per_cpu = v[-1]
    # how many processors the ranks share, in effect: k ranks busy at once on c cores run at
    # c / k of a processor each, which the profiled steps' wall per processor second says
    # (steadier than timing a piece of compute alone and together: 1.5-2.1 cores on one
    # machine from run to run, against 1.98-2.0 from the steps)
    cores = ranks / max(1.0, wall_per_cpu) if ranks > 1 else 0.0

    units = assemble_units(model, layout, st, (small, B), (f1, f2), (b1, b2), (saved_small, st["saved"]),
                           (out1, out2), shares, split_costs, shadows, (small, held_small))
    return Profile(
        units=units, **structure_fields(model, layout, st, linears), batch=B, measured_at=(small, B),
        step=dict(forward_s=tf2, backward_s=tb2, forward_small_s=tf1, backward_small_s=tb1),
        optimizer=opt, seconds=time.perf_counter() - start, ranks=ranks, cores=cores,
        working=line_through(small, working.get(small, 0.0), B, working.get(B, 0.0)), optimizer_temp=opt_temp,
        copy_per_byte=copy_s, action_s=action_s, wall_per_cpu=wall_per_cpu, scalars=tape.values)


def unit_kind(u) -> str:
    """A layout unit's place: "pre" (before the blocks), "block" or "post"."""
    return "block" if u.block is not None else ("pre" if u.before else "post")


def structure_fields(model: nn.Module, layout: Layout, st: dict, linears: list[Linear]) -> dict:
    """The Profile fields that follow from the model's structure and the structure run ``st``."""
    params = list(model.parameters())
    return dict(model_class=type(model).__name__, blocks=layout.blocks_name, modules=st["modules"],
                glue_params=list(layout.glue_parameters), tied=tied_parameters(model), linears=linears,
                legal_cuts=[not p for p in st["cut_problems"]], cut_problems=st["cut_problems"],
                backward_ops=st["backward_ops"], param_bytes=sum(p.numel() * p.element_size() for p in params),
                dtype_bytes=params[0].element_size() if params else 4)


def assemble_units(model: nn.Module, layout: Layout, st: dict, sizes: tuple, forward: tuple, backward: tuple,
                   saved: tuple, out: tuple, shares: dict, split_costs: dict, shadows: dict,
                   held: tuple = (1, {})) -> list[UnitProfile]:
    """The units' profiles from what was measured at the two batch sizes ``sizes``
    (``forward``, ``backward``, ``saved``, ``out``: a {unit: value} per size), the
    structure run ``st``, the per-cluster backward split (keyed by block signature) and
    ``held`` (samples, {unit: bytes a split backward keeps for W}), proportional to the
    samples."""
    small, B = sizes
    units = []
    counted: set = set()  # a tensor under two names (tied weights) counts with the first unit that holds it
    for u in layout.units:
        kind = unit_kind(u)
        own = [(n, p) for n, p in u.module.named_parameters() if id(p) not in counted]
        counted.update(id(p) for _, p in own)
        sig = signature(u.module)

        def line(pair, name=u.name):
            return line_through(small, pair[0].get(name, 0.0), B, pair[1].get(name, 0.0))
        units.append(UnitProfile(
            name=u.name, kind=kind, index=u.block, cls=type(u.module).__name__, signature=sig,
            param_bytes=sum(p.numel() * p.element_size() for _, p in own), param_numel=sum(p.numel() for _, p in own),
            params=[f"{u.name}.{n}" for n, _ in own], forward=line(forward), backward=line(backward),
            input_backward_share=shares.get(sig, 0.5) if kind == "block" else 0.5,
            split_backward_cost=split_costs.get(sig, 1.0) if kind == "block" else 1.0,
            shadow_s=shadows.get(u.name, 0.0), saved=line(saved), out_bytes=line(out),
            held_for_weights=(0.0, held[1].get(u.name, 0) / held[0]),
            flops=(0.0, st["flops"].get(u.name, 0.0) / B), ops=st["ops"].get(u.name, {}),
            side_inputs=st["side"].get(u.block, []) if u.block is not None else []))
    return units


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Parameters that are one tensor under several names."""
    names_of: dict[int, list[str]] = defaultdict(list)
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)].append(n)
    return [v for v in names_of.values() if len(v) > 1]


def _capture_block_inputs(model, layout: Layout, batch, loss_fn) -> dict[int, list]:
    """What each block receives (a forward with gradients on, so that the inputs that need
    them are known); tensors detached, those that needed a gradient as fresh leaves."""
    got: dict[int, list] = {}
    handles = []

    def keep(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone().requires_grad_(v.requires_grad)
        return v

    for u in layout.blocks:
        def pre(mod, args, kwargs, u=u):
            if u.block not in got:
                got[u.block] = [(k, tree_map(keep, v)) for k, v in list(enumerate(args)) + list(kwargs.items())]
        handles.append(u.module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        call_model(model, batch)
    finally:
        for h in handles:
            h.remove()
    return got
