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

import copy
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .._local import local_of
from ..parallel.pipeline.engine import loss_in
from ..parallel.pipeline.split import Layout, find_layout
from .host_memory import PeakInUse, in_use, malloc_counted
from .runtime_cost import action_seconds
from .scalars import ScalarTape

__all__ = ["Linear", "UnitProfile", "Profile", "profile_model", "call_model", "loss_of", "slice_batch",
           "batch_size_of"]


@dataclass
class Linear:
    """A module with one 2-d weight the tensor-parallel what-if can split."""

    name: str            # FQN of the module
    weight: str          # FQN of its weight
    bias: str | None
    shape: tuple         # the weight's shape
    out_dim: int         # the weight dim that indexes output features (0 for nn.Linear, 1 for Conv1D)
    fused: int = 1       # k > 1: the model splits its output into k equal pieces at once
    embedding: bool = False  # an nn.Embedding (the dim that indexes rows is the vocabulary)


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


# ---- calling the model --------------------------------------------------------------------------

def call_model(model: nn.Module, batch):
    """The model called on a batch as vescale.parallelize's model calls it."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_of(output, loss_fn=None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    loss = loss_in(output)
    if loss is None:
        raise TypeError(f"the model returned {type(output).__name__}, not a loss: give a sample batch with labels "
                        f"(e.g. targets / labels) or loss_fn=output -> scalar loss")
    if loss.dim() != 0:
        raise ValueError(f"the planner trains on the model's loss, a scalar; got shape {tuple(loss.shape)}")
    return loss


def batch_size_of(batch) -> int:
    sizes = [x.shape[0] for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not sizes:
        raise ValueError("the sample batch holds no tensor with a batch dim (dim 0); give e.g. (input_ids, targets)")
    return sizes[0]


def slice_batch(batch, n: int):
    """The first ``n`` samples of every tensor with the batch's dim 0."""
    full = batch_size_of(batch)
    return tree_map(lambda x: x[:n] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == full else x,
                    batch)


# ---- structure --------------------------------------------------------------------------------

def _signature(module: nn.Module) -> tuple:
    return (type(module).__name__,) + tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


def _linears(model: nn.Module) -> list[Linear]:
    out = []
    for name, m in model.named_modules():
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if w is None or w.dim() != 2:
            continue
        b = m._parameters.get("bias")
        if isinstance(m, nn.Embedding):
            out.append(Linear(name, f"{name}.weight", None, tuple(w.shape), 0, embedding=True))
            continue
        if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            out_dim = 1
        elif isinstance(m, nn.Linear):
            out_dim = 0
        elif b is not None and b.dim() == 1 and b.shape[0] in w.shape:
            out_dim = list(w.shape).index(b.shape[0])
        else:
            out_dim = 0
        out.append(Linear(name, f"{name}.weight", f"{name}.bias" if b is not None else None, tuple(w.shape), out_dim))
    return out


_SPLITS = {"aten::split.Tensor", "aten::split_with_sizes", "aten::unbind.int", "aten::chunk",
           "aten::unsafe_split.Tensor", "aten::unsafe_split_with_sizes"}


class _OpRecorder(TorchDispatchMode):
    """Counts the aten ops each module's forward runs (innermost module), the backward's in
    all, and notices outputs of linear layers split into equal pieces along the last dim."""

    def __init__(self, stack: list, linear_outputs: dict):
        super().__init__()
        self.stack, self.linear_outputs = stack, linear_outputs
        self.forward_ops: dict[str, Counter] = defaultdict(Counter)
        self.backward_ops: Counter = Counter()
        self.in_backward = False
        self.fused: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
        if self.in_backward:
            self.backward_ops[name] += 1
        else:
            self.forward_ops[self.stack[-1] if self.stack else ""][name] += 1
        out = func(*args, **kwargs)
        if name in _SPLITS and args and isinstance(args[0], torch.Tensor):
            owner = self.linear_outputs.get(id(args[0]))
            if owner is not None and isinstance(out, (tuple, list)) and len(out) > 1:
                x = args[0]
                dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) if name != "aten::unbind.int" else None
                if dim is not None and dim % x.dim() == x.dim() - 1 and len({o.shape[-1] for o in out}) == 1:
                    self.fused[owner] = len(out)
        return out


def storage_key(st) -> int:
    """One storage, however many tensors view it: its address, or on ``meta`` (where every
    storage's address is 0) the storage object's own."""
    return st.data_ptr() or st._cdata


def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# kernels torch's FLOP counter does not know (it would count the CPU's fused attention as 0)
_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def _structure(model: nn.Module, layout: Layout, batch, loss_fn, linears: list[Linear]):
    """One untimed step: module order and depth, ops, FLOPs per unit, saved bytes per unit,
    what crosses each block boundary, fused linear outputs."""
    names = {m: n for n, m in model.named_modules()}
    param_storages = {storage_key(p.untyped_storage()) for p in list(model.parameters()) + list(model.buffers())}
    order: dict[str, tuple] = {}
    stack: list[str] = []
    unit_of = {u.module: u.name for u in layout.units}
    current_unit: list[str] = []
    saved: dict[str, int] = defaultdict(int)
    seen_storages: set = set()
    linear_names = {lin.name for lin in linears if not lin.embedding}
    linear_outputs: dict[int, str] = {}
    block_inputs: dict[int, list] = {}
    block_outputs: dict[int, list] = {}
    handles = []

    def pre(mod, args, kwargs):
        n = names.get(mod, "?")
        order.setdefault(n, (len(order), n.count(".") + 1 if n else 0, type(mod).__name__))
        stack.append(n)
        if mod in unit_of:
            current_unit.append(unit_of[mod])
        u = next((x for x in layout.blocks if x.module is mod), None)
        if u is not None and u.block not in block_inputs:
            block_inputs[u.block] = [(k, v) for k, v in list(enumerate(args)) + list(kwargs.items())]

    def post(mod, args, kwargs, out):
        n = stack.pop() if stack else ""
        if mod in unit_of and current_unit:
            last_unit[0] = current_unit.pop()
        if n in linear_names and isinstance(out, torch.Tensor):
            linear_outputs[id(out)] = n
        u = next((x for x in layout.blocks if x.module is mod), None)
        if u is not None and u.block not in block_outputs:
            block_outputs[u.block] = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))

    last_unit = [layout.units[0].name if layout.units else ""]

    def pack(t):
        st = t.untyped_storage()
        ptr = storage_key(st)
        if ptr not in param_storages and ptr not in seen_storages and not recorder.in_backward:
            seen_storages.add(ptr)
            # glue before the first unit counts with it, glue after a unit (the loss) with that unit
            owner = current_unit[-1] if current_unit else last_unit[0]
            saved[owner] += st.nbytes()
        return t

    recorder = _OpRecorder(stack, linear_outputs)
    flops = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    try:
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with flops:  # forward FLOPs only
                loss = loss_of(call_model(model, batch), loss_fn)
            recorder.in_backward = True
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    counts = flops.get_flop_counts()
    root = type(model).__name__
    unit_flops = {}
    for u in layout.units:
        key = f"{root}.{u.name}"
        unit_flops[u.name] = float(sum(counts.get(key, {}).values()))
    for lin in linears:
        lin.fused = recorder.fused.get(lin.name, 1)
    # ops per unit (its own forward and its submodules')
    unit_ops = {}
    for u in layout.units:
        c = Counter()
        for mod_name, ops in recorder.forward_ops.items():
            if mod_name == u.name or mod_name.startswith(u.name + "."):
                c.update(ops)
        unit_ops[u.name] = dict(c)
    # cuts: what block i receives that needs a gradient must be block i-1's output
    problems: list[str] = []
    side: dict[int, list[str]] = {}
    for i in range(len(layout.blocks)):
        ins = block_inputs.get(i, [])
        side[i] = [str(k) for k, v in ins if isinstance(v, torch.Tensor) and not v.requires_grad]
        if i == 0:
            continue
        prev = {id(t) for t in block_outputs.get(i - 1, [])}
        bad = [str(k) for k, v in ins for t in tree_flatten(v)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in prev]
        problems.append(f"it takes {bad} that need gradients and are not block {i - 1}'s output" if bad else "")
    modules = [(n, depth, cls) for n, (_, depth, cls) in sorted(order.items(), key=lambda kv: kv[1][0])]
    return dict(modules=modules, flops=unit_flops, saved=dict(saved), ops=unit_ops,
                backward_ops=dict(recorder.backward_ops), cut_problems=problems, side=side)


# ---- timing -------------------------------------------------------------------------------------

class _Timer:
    """Hooks on the units only: forward spans (gaps charged to the next unit, the tail to
    the last), backward from the time each unit's output gets its gradient.

    The spans are read in processor time and the forward's (the backward's) wall time is
    shared among the units in proportion to them. Ranks that share the cores are
    descheduled for whole time slices, which a wall clock charges to whichever short unit
    was running; over a whole forward the wall time is steady, and the processor time says
    which unit it went to (read off wall clocks, a block's per-call cost came out 0-1.2 ms
    in one profile where its processor time says 1.3)."""

    def __init__(self, layout: Layout, wall_per_cpu: float | None = None):
        self.units = layout.units
        # None: each phase's wall time shared among the units; else their processor
        # time at this rate (a run timed while other ranks sit idle, put on the profile's footing)
        self.wall_per_cpu = wall_per_cpu
        self.ratios: list[float] = []  # wall per processor second of each phase
        self.on_forward_end = None     # called between a step's forward and backward
        self.fwd_events: list[tuple] = []
        self.grad_events: dict[str, float] = {}
        self.out_bytes: dict[str, int] = {}
        self.handles = []
        clock = time.process_time
        for u in self.units:
            def pre(mod, args, u=u):
                self.fwd_events.append((u.name, "pre", clock()))

            def post(mod, args, out, u=u):
                self.fwd_events.append((u.name, "post", clock()))
                nbytes = 0
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                        nbytes += t.numel() * t.element_size()
                        if torch.is_grad_enabled():
                            t.register_hook(lambda g, name=u.name: self._grad(name))
                self.out_bytes.setdefault(u.name, nbytes)
            self.handles.append(u.module.register_forward_pre_hook(pre))
            self.handles.append(u.module.register_forward_hook(post))

    def _grad(self, name: str) -> None:
        self.grad_events.setdefault(name, time.process_time())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def step(self, model, batch, loss_fn) -> tuple[dict, dict, float, float]:
        self.fwd_events.clear()
        self.grad_events.clear()
        w0, t0 = time.perf_counter(), time.process_time()
        loss = loss_of(call_model(model, batch), loss_fn)
        w1, t1 = time.perf_counter(), time.process_time()
        if self.on_forward_end is not None:
            self.on_forward_end()
        loss.backward()
        w2, t2 = time.perf_counter(), time.process_time()
        fwd: dict[str, float] = defaultdict(float)
        last_end, open_at, pending_gap = t0, {}, 0.0
        last_unit = None
        for name, kind, t in self.fwd_events:
            if kind == "pre":
                if not open_at:  # a top-level unit starts: the glue since the last one goes to it
                    pending_gap = t - last_end
                open_at.setdefault(name, t)
            elif name in open_at:
                start = open_at.pop(name)
                if not open_at:
                    fwd[name] += t - start + pending_gap
                    last_end, last_unit, pending_gap = t, name, 0.0
        if last_unit is not None:
            fwd[last_unit] += t1 - last_end  # the loss and the glue after the last unit
        bwd: dict[str, float] = defaultdict(float)
        events = sorted(self.grad_events.items(), key=lambda kv: kv[1])
        for i, (name, t) in enumerate(events):
            end = events[i + 1][1] if i + 1 < len(events) else t2
            bwd[name] += end - t
            if i == 0:
                bwd[name] += t - t1
        self.ratios += [(w1 - w0) / max(t1 - t0, 1e-9), (w2 - w1) / max(t2 - t1, 1e-9)]
        return self._to_wall(fwd, w1 - w0, t1 - t0), self._to_wall(bwd, w2 - w1, t2 - t1), w1 - w0, w2 - w1

    def _to_wall(self, spans: dict, wall: float, cpu: float) -> dict:
        if self.wall_per_cpu is not None:
            return {k: v * self.wall_per_cpu for k, v in spans.items()}
        return _to_wall(spans, wall, cpu)


def _to_wall(spans: dict, wall: float, cpu: float) -> dict:
    """Processor-time spans as shares of the phase's wall time."""
    scale = wall / cpu if cpu > 0 else 1.0
    return {k: v * scale for k, v in spans.items()}


def saved_per_unit(model: nn.Module, layout: Layout, batch, loss_fn=None) -> dict[str, int]:
    """Bytes saved for backward during one forward, per unit (storages counted once, the
    parameters' not; a DTensor counts its local shard; glue counts with the unit before it,
    or the first unit)."""
    def storage(t):
        return local_of(t).untyped_storage()

    params = set()
    for t in list(model.parameters()) + list(model.buffers()):
        try:
            params.add(storage_key(storage(t)))
        except RuntimeError:
            pass
    current: list[str] = []
    last = [layout.units[0].name if layout.units else ""]
    saved: dict[str, int] = defaultdict(int)
    seen: set = set()
    handles = []
    for u in layout.units:
        handles.append(u.module.register_forward_pre_hook(lambda m, a, n=u.name: current.append(n)))
        handles.append(u.module.register_forward_hook(lambda m, a, o: last.__setitem__(0, current.pop())))

    def pack(t):
        try:
            st = storage(t)
        except RuntimeError:
            return t
        ptr = storage_key(st)
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[current[-1] if current else last[0]] += st.nbytes()
        return t
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(call_model(model, batch), loss_fn)
        del loss
    finally:
        for h in handles:
            h.remove()
    return dict(saved)


def _held_for_weights(model, layout: Layout, batch, loss_fn) -> dict[str, int]:
    from .split_backward import held_for_weights
    try:
        return held_for_weights(model, layout, batch, loss_fn)
    except RuntimeError:  # a model torch's split backward cannot take apart: the schedules that split fail anyway
        return {}


def robust(values) -> float:
    """The mean of the faster half of some timings: on a shared machine, noise only ever
    adds time, and a single lucky run is not typical either."""
    v = sorted(values)
    half = v[: max(1, len(v) // 2)]
    return sum(half) / len(half)


def _median_times(model, layout, batch, loss_fn, steps: int, wall_per_cpu: float | None = None,
                  ratios: list | None = None, working: dict | None = None) -> tuple[dict, dict, float, float, dict]:
    """Median forward and backward seconds per unit (and in all) over ``steps`` after a
    warm-up; ``wall_per_cpu`` as in ``_Timer``; ``ratios`` collects each phase's wall per
    processor second; ``working[batch size]``: the most bytes the warm-up added (``in_use``),
    at the forward's end, or in the backward less the gradients it made."""
    timer = _Timer(layout, wall_per_cpu)
    fwds, bwds, tf, tb = defaultdict(list), defaultdict(list), [], []
    grads = sum(local_of(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    try:
        for i in range(steps + 1):
            watch = PeakInUse().watch(model) if working is not None and i == 0 and malloc_counted() else None
            base = in_use()
            at_forward_end = []
            timer.on_forward_end = (lambda: at_forward_end.append(watch.peak)) if watch is not None else None
            f, b, a, c = timer.step(model, batch, loss_fn)
            if watch is not None:  # the forward's peak, or the backward's less the gradients it made
                whole = watch.close()
                working[batch_size_of(batch)] = max(0.0, float(at_forward_end[0] - base), float(whole - base - grads))
            model.zero_grad(set_to_none=True)
            if i == 0:
                continue  # warm-up
            for u in layout.units:
                fwds[u.name].append(f.get(u.name, 0.0))
                bwds[u.name].append(b.get(u.name, 0.0))
            tf.append(a)
            tb.append(c)
    finally:
        timer.remove()
    if ratios is not None:
        ratios += timer.ratios[2:]  # not the warm-up's
    med = robust
    return ({k: med(v) for k, v in fwds.items()}, {k: med(v) for k, v in bwds.items()}, med(tf), med(tb),
            dict(timer.out_bytes))


_CACHE_KWARGS = {"past_key_values", "past_key_value", "layer_past", "use_cache"}


def without_cache(args, kwargs):
    """A module's captured arguments without a KV cache (Hugging Face's default forward
    keeps one: reused, it would chain one call's graph to the next)."""
    args = [None if type(v).__name__.endswith("Cache") else v for v in args]
    kwargs = {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}
    for k in _CACHE_KWARGS & set(kwargs):
        kwargs[k] = False if k == "use_cache" else None
    return args, kwargs


def _input_share(block: nn.Module, inputs: list, steps: int = 3) -> tuple[float, float]:
    """The input-gradient part of a block's backward (torch's split of the autograd graph,
    as the zero-bubble schedules run it), and what the split costs: (input-gradient part
    / both parts, both parts / a plain backward), measured on a copy of the block."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    mod = copy.deepcopy(block)
    ins, shares, costs = [], [], []
    for k, v in inputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            ins.append((k, v.detach().clone().requires_grad_()))
        else:
            ins.append((k, v))
    positional = {k: v for k, v in ins if isinstance(k, int)}
    args, kwargs = without_cache([positional.get(i) for i in range(max(positional, default=-1) + 1)],
                                 {k: v for k, v in ins if not isinstance(k, int)})
    leaves = [v for _, v in ins if isinstance(v, torch.Tensor) and v.requires_grad]
    if not leaves:
        return 0.5, 1.0
    plain = []
    for i in range(steps + 1):
        out = mod(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        t0 = time.perf_counter()
        _, groups = stage_backward_input(outs, grads, leaves, iter(list(mod.parameters())))
        t1 = time.perf_counter()
        stage_backward_weight(iter(list(mod.parameters())), groups)
        t2 = time.perf_counter()
        out = mod(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        t3 = time.perf_counter()
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        t4 = time.perf_counter()
        for lf in leaves:
            lf.grad = None
        mod.zero_grad(set_to_none=True)
        if i:
            shares.append((t1 - t0) / max(t2 - t0, 1e-9))
            costs.append(t2 - t0)
            plain.append(t4 - t3)
    return statistics.median(shares), max(1.0, robust(costs) / max(robust(plain), 1e-9))


def meta_forward_times(model: nn.Module, layout: Layout, batch, loss_fn=None, steps: int = 2) -> dict[str, float]:
    """Seconds each unit's forward takes on meta tensors: what a pipeline stage pays to run
    the units of the stages before it as shadows (vescale's stages run the model's own
    forward; units they do not own run on meta so that glue code keeps working). As in a
    stage, a shadow called with inputs of shapes seen before (every step after the first)
    returns its remembered outputs without running (``ShadowCache``): the times are those
    of such warm steps."""
    from ..parallel.pipeline.stage import ShadowCache
    from .whatif import meta_copy  # (whatif imports this module)

    meta = meta_copy(model)
    mlayout = find_layout(meta, layout.blocks_name)
    cache = ShadowCache()
    for u in mlayout.units:
        u.module.forward = cache.wrap(u.name, u.module.forward)
    timer = _Timer(mlayout)
    out: dict[str, list] = defaultdict(list)
    try:
        with torch.no_grad():
            for i in range(steps + 1):
                timer.fwd_events.clear()
                w0, t0 = time.perf_counter(), time.process_time()
                try:
                    call_model(meta, tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, batch))
                except Exception:  # noqa: BLE001  (a model that cannot run on meta: no shadow cost known)
                    return {}
                wall, cpu = time.perf_counter() - w0, time.process_time() - t0
                if not i:
                    continue
                spans: dict[str, float] = defaultdict(float)
                open_at: dict[str, float] = {}
                for name, kind, t in timer.fwd_events:
                    if kind == "pre":
                        open_at[name] = t
                    elif name in open_at:
                        spans[name] += t - open_at.pop(name)
                for n, v in _to_wall(spans, wall, cpu).items():
                    out[n].append(v)
    finally:
        timer.remove()
    return {n: robust(v) for n, v in out.items()}


def _optimizer_times(model: nn.Module, steps: int = 3) -> tuple[tuple[float, float], float]:
    """AdamW step seconds as a * tensors + b * elements, from steps on copies of the
    parameters and on quarter-size slices of them (ZeRO's flat slices); and the bytes per
    element a step (its state there) leaves in use beyond the state."""
    params = [p for p in model.parameters() if p.requires_grad]
    added = [0]

    def timed(tensors, memory=False):
        copies = [t.detach().float().clone().requires_grad_() for t in tensors]
        for c in copies:
            c.grad = torch.zeros_like(c)
        opt = torch.optim.AdamW(copies, lr=1e-4)
        runs = []
        for i in range(steps + 2):
            base = in_use()
            t0 = time.perf_counter()
            opt.step()
            if i > 1:
                runs.append(time.perf_counter() - t0)
            if memory and i == 1:
                added[0] = max(0, in_use() - base)
        return robust(runs)

    full = timed(params, memory=malloc_counted())
    small = timed([p.detach().reshape(-1)[: max(1, p.numel() // 8)] for p in params])
    n = sum(p.numel() for p in params)
    if not n:
        return (0.0, 0.0), 0.0
    temp = added[0] / n
    b = (full - small) / (0.875 * n)
    if b <= 0:  # noise: all of it per element
        return (0.0, full / n), temp
    a = max(0.0, (full - b * n) / max(len(params), 1))
    return (a, b), temp


def copy_seconds_per_byte(nbytes: int = 8 << 20, reps: int = 5) -> float:
    """Seconds per byte of a large tensor copy (what DDP's buckets and ZeRO's slices cost
    around their collectives)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    runs = []
    for i in range(reps + 1):
        t = time.perf_counter()
        dst.copy_(src)
        if i:
            runs.append(time.perf_counter() - t)
    return robust(runs) / nbytes


def _line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """(a, b) with y = a + b x through two points; a line through the origin when x1 == x2."""
    if x2 == x1:
        return 0.0, y2 / x2 if x2 else 0.0
    b = (y2 - y1) / (x2 - x1)
    a = y1 - b * x1
    if a < 0 or b < 0:  # noise: keep it proportional
        return 0.0, max(y2, 0.0) / x2
    return a, b


# ---- the profile ------------------------------------------------------------------------------

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
    linears = _linears(model)
    try:
        small_batch = slice_batch(sample_batch, small)
        st = _structure(model, layout, sample_batch, loss_fn, linears)
        saved_small = saved_per_unit(model, layout, small_batch, loss_fn)
        held_small = _held_for_weights(model, layout, small_batch, loss_fn)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the ranks time together, as they will train
        ratios: list[float] = []
        working: dict = {}
        f2, b2, tf2, tb2, out2 = _median_times(model, layout, sample_batch, loss_fn, steps, ratios=ratios,
                                               working=working)
        f1, b1, tf1, tb1, out1 = _median_times(model, layout, small_batch, loss_fn, steps, ratios=ratios,
                                               working=working)
        wall_per_cpu = statistics.median(ratios)
        # the input-gradient share of each block cluster's backward, and the split's cost
        shares: dict = {}
        split_costs: dict = {}
        with ScalarTape() as tape:  # what the what-if runs on meta will need to be told
            block_inputs = _capture_block_inputs(model, layout, small_batch, loss_fn)
        for u in layout.blocks:
            sig = _signature(u.module)
            if sig not in shares and u.block in block_inputs:
                try:
                    shares[sig], split_costs[sig] = _input_share(u.module, block_inputs[u.block])
                except RuntimeError:  # a block torch's split backward cannot take apart: half and half
                    shares[sig], split_costs[sig] = 0.5, 1.0
        opt, opt_temp = _optimizer_times(model)
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
        gathered = [None] * ranks  # the median over ranks: one rank descheduled for a while does not count
        dist.all_gather_object(gathered, vec)
        v = [statistics.median(col) for col in zip(*gathered)]
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
        working=_line(small, working.get(small, 0.0), B, working.get(B, 0.0)), optimizer_temp=opt_temp,
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
        sig = _signature(u.module)

        def line(pair, name=u.name):
            return _line(small, pair[0].get(name, 0.0), B, pair[1].get(name, 0.0))
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
