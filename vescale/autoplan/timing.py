"""Timing and measuring memory of the units of an unmodified model in real eager steps:
forward and backward per unit (hooks on the units, processor time shared out of the wall
time), bytes saved for backward, the split backward's input-gradient share, a unit's
forward on meta, the optimizer step, a large copy; and the straight line ``a + b * n``
through two batch sizes that every measurement is kept as."""

from __future__ import annotations

import copy
import statistics
import time
from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .._local import local_of
from ..parallel.pipeline.split import Layout, find_layout
from .calling import batch_size_of, call_model, loss_of, without_cache
from .host_memory import PeakInUse, in_use, malloc_counted
from .structure import storage_key


class Timer:
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


def held_for_weights_if_splittable(model, layout: Layout, batch, loss_fn) -> dict[str, int]:
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


def median_times(model, layout, batch, loss_fn, steps: int, wall_per_cpu: float | None = None,
                  ratios: list | None = None, working: dict | None = None) -> tuple[dict, dict, float, float, dict]:
    """Median forward and backward seconds per unit (and in all) over ``steps`` after a
    warm-up; ``wall_per_cpu`` as in ``Timer``; ``ratios`` collects each phase's wall per
    processor second; ``working[batch size]``: the most bytes the warm-up added (``in_use``),
    at the forward's end, or in the backward less the gradients it made."""
    timer = Timer(layout, wall_per_cpu)
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




def input_share(block: nn.Module, inputs: list, steps: int = 3) -> tuple[float, float]:
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
    from .virtual import meta_copy  # (virtual imports profile, which imports this module)

    meta = meta_copy(model)
    mlayout = find_layout(meta, layout.blocks_name)
    cache = ShadowCache()
    for u in mlayout.units:
        u.module.forward = cache.wrap(u.name, u.module.forward)
    timer = Timer(mlayout)
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


def optimizer_times(model: nn.Module, steps: int = 3) -> tuple[tuple[float, float], float]:
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


def line_through(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """(a, b) with y = a + b x through two points; a line through the origin when x1 == x2."""
    if x2 == x1:
        return 0.0, y2 / x2 if x2 else 0.0
    b = (y2 - y1) / (x2 - x1)
    a = y1 - b * x1
    if a < 0 or b < 0:  # noise: keep it proportional
        return 0.0, max(y2, 0.0) / x2
    return a, b
