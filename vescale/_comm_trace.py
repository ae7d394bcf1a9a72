"""vescale.debug.comm_trace and detect_anomaly: the module scopes they report in.

Module scopes come from torch's ``ModTracker`` (torch.distributed._tools.mod_tracker),
which follows forward through global module hooks and backward through multi-grad hooks
on each module's inputs and outputs. Its module names are FQNs prefixed with the root
module's class name (``GPT.blocks.0.attn``); outside every module the scope is
``Global``. Whenever the innermost module changes, the tracker tells the engine its
scope id, which every recorded collective (and a NaN/Inf report) carries.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_map_only

from . import _C

_GLOBAL = "Global"


def _depth(name: str) -> int:
    return -1 if name == _GLOBAL else name.count(".")


def split_scope(scope: int) -> tuple[str, str]:
    """A scope id as (module, "forward" | "backward"); ("", "") for none."""
    name = _C.scope_name(scope)
    if not name:
        return "", ""
    module, _, phase = name.rpartition(" (")
    return module, phase.rstrip(")")


class ScopeTracker(ModTracker):
    """ModTracker that keeps the engine's scope id on the innermost running module and
    remembers when each module's forward and backward ran (for the Chrome trace).

    ``on_forward_end`` runs when the outermost module's forward returns,
    ``on_backward_end`` when a backward that went through modules finishes.
    """

    def __init__(self, *, on_forward_end: Callable[[], None] | None = None,
                 on_backward_end: Callable[[], None] | None = None,
                 on_module_output: Callable[[str, object], None] | None = None, spans: bool = False):
        super().__init__()
        self._on_forward_end = on_forward_end
        self._on_backward_end = on_backward_end
        self._on_module_output = on_module_output
        self._keep_spans = spans
        self.spans: list[tuple[str, str, int, int]] = []  # (module, phase, start_ns, end_ns)
        self._open: dict[tuple[str, bool], list[int]] = defaultdict(list)
        self._queued = False
        if on_module_output is not None:
            self.register_user_hooks(post_fw_hook=self._module_output)

    def _fw_pre_hook(self, mod, input):
        # torch's hook waits for the gradients of all the inputs that require grad, and on
        # the first one asks the engine whether each input's node will run, which raises
        # for a leaf inside torch.autograd.grad. A zero-bubble schedule's split backward
        # runs through autograd.grad, with the received activations as leaves: leaves are
        # hidden from it (the module's backward ends with its other inputs' gradients, or
        # with the backward itself when all are leaves)
        return super()._fw_pre_hook(mod, tree_map_only(torch.Tensor, _hide_leaf, input))

    def _module_output(self, mod, inputs, output) -> None:
        self._on_module_output(self.get_known_fqn(mod) or type(mod).__name__, output)

    def _update(self) -> None:
        innermost = max(self.parents, key=_depth)
        _C.trace_set_scope(_C.scope_id(innermost, self.is_bw))

    def _get_append_fn(self, w_mod, name, is_bw):
        fn = super()._get_append_fn(w_mod, name, is_bw)

        def entered(*args):
            fn(*args)
            if self._keep_spans:
                self._open[(name, is_bw)].append(_C.trace_now_ns())
            self._update()

        return entered

    def _get_pop_fn(self, w_mod, name, is_bw):
        fn = super()._get_pop_fn(w_mod, name, is_bw)

        def left(*args):
            if name in self.parents or is_bw:
                fn(*args)
            # else: a backward ran inside this module's forward (a pipeline schedule's
            # step does) and its end reset the parents; ModTracker would raise here
            if self._keep_spans and self._open[(name, is_bw)]:
                start = self._open[(name, is_bw)].pop()
                self.spans.append((name, "backward" if is_bw else "forward", start, _C.trace_now_ns()))
            self._update()
            if not is_bw and self.parents == {_GLOBAL} and not self.is_bw and self._on_forward_end is not None:
                self._on_forward_end()

        return left

    def _maybe_set_engine_callback(self):
        first = not self._has_callback
        super()._maybe_set_engine_callback()
        if first:  # after ModTracker's own callback, which resets `parents`
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._update()
        if self._on_backward_end is not None:
            self._on_backward_end()

    def __enter__(self):
        super().__enter__()
        self._update()
        return self

    def __exit__(self, *args):
        super().__exit__(*args)
        _C.trace_set_scope(0)


def _hide_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad and t.grad_fn is None else t


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"


class CommTrace:
    """What ``vescale.debug.comm_trace()`` recorded on this rank.

    ``events``: one dict per collective or transfer, oldest first, with ``kind``,
    ``group``, ``group_size``, ``mesh_dim`` / ``mesh_dim_name`` (-1 / "" for groups that
    are not a mesh dim's), ``bytes`` (this rank's input), ``start_ns`` / ``end_ns``
    (steady clock), ``op`` (the aten op or API call that issued it; "" for Python
    components), ``source`` ("engine", "ddp", "zero", "optimizer", "pipeline"),
    ``peer`` (send/recv), ``module`` and ``phase`` ("forward" / "backward").
    """

    def __init__(self, *, modules: bool = True):
        self.modules = modules
        self.events: list[dict] = []
        self.spans: list[tuple[str, str, int, int]] = []
        self.rank = _rank()
        self._tracker: ScopeTracker | None = None
        self._first = 0
        self._wall_minus_steady = 0

    # ---- recording ----

    def __enter__(self) -> CommTrace:
        self.rank = _rank()
        self._wall_minus_steady = time.time_ns() - _C.trace_now_ns()
        if self.modules:
            self._tracker = ScopeTracker(spans=True).__enter__()
        self._first = _C.trace_event_count()
        _C.trace_collectives(True)
        return self

    def __exit__(self, *exc) -> None:
        _C.trace_collectives(False)
        raw = _C.trace_events(self._first)
        if not _C.trace_recording():  # the last recorder: the record starts afresh next time
            _C.trace_clear()
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self.spans = list(self._tracker.spans)
            self._tracker = None
        for e in raw:
            e["module"], e["phase"] = split_scope(e["scope"])
            if not e["module"]:
                e["module"], e["phase"] = _GLOBAL, ""
        self.events = raw
        if _C.trace_dropped():
            import warnings

            warnings.warn(f"vescale.debug.comm_trace: the record was full ({_C.trace_max_events()} events); "
                          f"{_C.trace_dropped()} later ones were dropped", stacklevel=2)

    # ---- summaries ----

    def by_module(self) -> dict[str, dict[str, dict[str, tuple[int, int]]]]:
        """{module: {phase: {kind: (calls, bytes)}}}, each event counted at the innermost
        module that was running when it was issued."""
        out: dict = {}
        for e in self.events:
            per_kind = out.setdefault(e["module"], {}).setdefault(e["phase"] or "-", {})
            calls, nbytes = per_kind.get(e["kind"], (0, 0))
            per_kind[e["kind"]] = (calls + 1, nbytes + e["bytes"])
        return out

    def totals(self) -> dict[str, tuple[int, int]]:
        """{kind: (calls, bytes)} over the whole trace."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.events:
            calls, nbytes = out.get(e["kind"], (0, 0))
            out[e["kind"]] = (calls + 1, nbytes + e["bytes"])
        return out

    def __str__(self) -> str:
        per = self.by_module()
        total_calls = len(self.events)
        total_bytes = sum(e["bytes"] for e in self.events)
        lines = [f"comm_trace on rank {self.rank}: {total_calls} collectives and transfers, {_human(total_bytes)}"]
        if not per:
            return lines[0]
        # The module tree: every module with traffic, under its parents (which may have none).
        names = set(per)
        for name in list(names):
            parts = name.split(".")
            for k in range(1, len(parts)):
                names.add(".".join(parts[:k]))
        order = sorted(names, key=lambda n: (n != _GLOBAL, n.split(".")))

        def subtree_totals(name):
            calls = nbytes = 0
            for other, phases in per.items():
                if other == name or other.startswith(name + "."):
                    for kinds in phases.values():
                        for c, b in kinds.values():
                            calls, nbytes = calls + c, nbytes + b
            return calls, nbytes

        for name in order:
            indent = "  " * (0 if name == _GLOBAL else name.count("."))
            calls, nbytes = subtree_totals(name)
            lines.append(f"{indent}{name}  (with submodules: {calls} calls, {_human(nbytes)})")
            for phase in ("forward", "backward", "-"):
                kinds = per.get(name, {}).get(phase)
                if not kinds:
                    continue
                desc = ", ".join(f"{kind} x{c} ({_human(b)})" for kind, (c, b) in sorted(kinds.items()))
                lines.append(f"{indent}  {phase if phase != '-' else 'outside modules'}: {desc}")
        return "\n".join(lines)

    __repr__ = __str__

    # ---- Chrome / Perfetto ----

    def chrome_events(self) -> list[dict]:
        """This rank's events in Chrome trace format (microseconds on the wall clock,
        process = rank): collectives on one track, module forward and backward spans on
        two more."""
        rank = self.rank
        shift = self._wall_minus_steady

        def us(ns):
            return (ns + shift) / 1000.0

        out = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
               {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        for tid, label in ((1, "collectives"), (2, "modules: forward"), (3, "modules: backward")):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
        for e in self.events:
            args = {k: e[k] for k in ("bytes", "group", "group_size", "mesh_dim", "mesh_dim_name", "op", "module",
                                      "phase", "source", "peer")}
            out.append({"name": e["kind"], "cat": e["source"], "ph": "X", "pid": rank, "tid": 1,
                        "ts": us(e["start_ns"]), "dur": max((e["end_ns"] - e["start_ns"]) / 1000.0, 0.001),
                        "args": args})
        for module, phase, start, end in self.spans:
            out.append({"name": module, "cat": "module", "ph": "X", "pid": rank,
                        "tid": 2 if phase == "forward" else 3, "ts": us(start),
                        "dur": max((end - start) / 1000.0, 0.001)})
        return out

    def to_chrome_trace(self, path: str | os.PathLike, *, gather: bool = True) -> str | None:
        """Writes a trace that chrome://tracing and ui.perfetto.dev open, one process
        track per rank.

        With ``gather`` (the default) and torch.distributed running, this is collective:
        every rank calls it, rank 0 gathers the events and writes ``path``, and the path
        is returned on rank 0 (None elsewhere). With ``gather=False`` each rank writes its
        own file: ``path`` formatted with ``rank=`` when it contains ``{rank}``, else
        ``path`` with ``.rank<r>`` before its suffix; ``merge_chrome_traces`` joins such
        files. Times are the ranks' wall clocks (in microseconds), shifted so that the
        earliest event starts at 0 in a gathered file.
        """
        events = self.chrome_events()
        path = os.fspath(path)
        if gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(events, gathered, dst=0)
            if dist.get_rank() != 0:
                return None
            events = [e for rank_events in gathered for e in rank_events]
            _write_trace(path, events)
            return path
        if not gather:
            path = _rank_path(path, self.rank)
        _write_trace(path, events)
        return path


def _rank_path(path: str, rank: int) -> str:
    if "{rank}" in path:
        return path.format(rank=rank)
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def _write_trace(path: str, events: list[dict]) -> None:
    timed = [e["ts"] for e in events if "ts" in e]
    origin = min(timed) if timed else 0.0
    for e in events:
        if "ts" in e:
            e["ts"] = e["ts"] - origin
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def merge_chrome_traces(paths, out: str | os.PathLike) -> str:
    """Joins per-rank trace files (``to_chrome_trace(..., gather=False)``) into one."""
    events: list[dict] = []
    for p in paths:
        with open(p) as f:
            events.extend(json.load(f)["traceEvents"])
    # per-rank files are shifted to their own origin: undo it by the wall clock they all share
    _write_trace(os.fspath(out), events)
    return os.fspath(out)


def comm_trace(*, modules: bool = True) -> CommTrace:
    """Records every collective and point-to-point transfer issued on this rank while the
    ``with`` block runs: the engine's redistributions (with the aten op that needed them),
    DDP's bucket all-reduces, ZeRO's reduce-scatters and gathers, the optimizer's norm
    reductions and the pipeline's sends and receives, each with the module (FQN) that was
    running, forward or backward. ``modules=False`` records without module hooks (no
    Python per module; the planner uses it on meta tensors over a fake process group).

        with vescale.debug.comm_trace() as t:
            loss = model(x); loss.backward()
        print(t)                              # per-module tree: calls and bytes per kind
        t.to_chrome_trace("trace.json")       # every rank calls it; rank 0 writes
    """
    return CommTrace(modules=modules)


# ---- NaN/Inf localisation -----------------------------------------------------------------

class AnomalyError(RuntimeError):
    """A NaN or Inf appeared under vescale.debug.detect_anomaly()."""


def _nonfinite(t) -> bool:
    return (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.is_meta
            and t.numel() > 0 and not bool(torch.isfinite(t).all()))


class _AnomalyDetector:
    def __init__(self, sync: bool, group):
        self.sync = sync
        self.group = group
        self.tracker: ScopeTracker | None = None
        self.plain: dict | None = None  # a non-finite plain-tensor module output

    def _module_output(self, module: str, output) -> None:
        from torch.utils._pytree import tree_leaves

        from .dtensor import DTensor

        if self.plain is not None or _C.first_anomaly() is not None:
            return
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and _nonfinite(t.detach()):
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                self.plain = {"op": "", "module": f"{module} ({phase})", "rank": _rank(), "inputs_finite": True,
                              "message": f"vescale.debug.detect_anomaly: module {module} returned a plain "
                                         f"(non-DTensor) tensor holding NaN/Inf on rank {_rank()} ({phase}); "
                                         "ops on plain tensors are not checked one by one, so the op is not known"}
                if not self.sync:
                    raise AnomalyError(self.plain["message"])
                return

    def agree(self) -> None:
        """All ranks of the group learn whether any rank saw a NaN/Inf, and raise alike."""
        mine = _C.first_anomaly() or self.plain
        if not (dist.is_available() and dist.is_initialized()):
            if mine is not None:
                raise AnomalyError(mine["message"])
            return
        flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag[0]) == 0:
            return
        world = dist.get_world_size(self.group)
        reports = [None] * world
        dist.all_gather_object(reports, mine, group=self.group)
        found = [r for r in reports if r is not None]
        # Where it starts: an op whose inputs were finite, on the lowest such rank (a rank
        # whose first non-finite op took NaN from another rank's data saw a later symptom).
        first = min(found, key=lambda r: (not r["inputs_finite"], r["rank"]))
        message = first["message"]
        others = [r for r in found if r is not first]
        if others:
            message += "; also " + "; ".join(
                f"rank {r['rank']}: {r['op'] or 'a plain tensor'}" + (f" in {r['module']}" if r["module"] else "")
                for r in sorted(others, key=lambda r: r["rank"]))
        raise AnomalyError(message)


class detect_anomaly:
    """Finds the first op that produces a NaN or Inf, with its module and rank.

        with vescale.debug.detect_anomaly():
            loss = model(x); loss.backward()

    Every op on DTensors checks its local results (forward and backward ops alike: the
    backward's ops go through the same dispatch), and module outputs that are plain
    tensors are checked at each module's end. The check runs in the engine's op handler,
    behind the flag word that is zero when nothing observes (so it costs nothing when
    off), not in a Python dispatch mode (which would put Python on every op): one
    ``isfinite().all()`` per floating result, a device synchronisation each on GPUs.

    With ``sync=True`` (the default) ranks agree at the end of each outermost forward,
    each backward and the block: one tiny all-reduce over ``group`` (the world by
    default), and when any rank saw a NaN/Inf every rank raises the same AnomalyError
    naming the op, the module (forward or backward) and the rank. Under pipeline
    parallelism ranks run different modules: use ``sync=False``, where the rank that
    sees it raises at once, inside the op (the traceback then shows the model's line;
    the other ranks fail at their next collective with it).
    """

    def __init__(self, *, sync: bool = True, group=None):
        self._detector = _AnomalyDetector(sync, group)

    def __enter__(self):
        d = self._detector
        _C.reset_anomaly()
        _C.anomaly_begin(raise_at_op=not d.sync)
        d.tracker = ScopeTracker(on_forward_end=d.agree if d.sync else None,
                                 on_backward_end=d.agree if d.sync else None,
                                 on_module_output=d._module_output).__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        d = self._detector
        try:
            d.tracker.__exit__(kind, value, tb)
        finally:
            _C.anomaly_end(raise_at_op=not d.sync)
        if kind is None and d.sync:
            d.agree()
        _C.reset_anomaly()
        if isinstance(value, RuntimeError) and not isinstance(value, AnomalyError) and \
                str(value).startswith("vescale.debug.detect_anomaly"):
            raise AnomalyError(str(value).split("\n")[0]) from value  # raised inside the op (sync=False)
