"""Introspection of the engine: which ops ran through the replicate fallback, and
how often sharding decisions were computed (cache misses); checks of the collectives
ranks issue (``debug_mode``), and a note on errors raised because another rank failed.

Seeing into the engine (see docs/engine.md, "Seeing into the engine"):

- ``comm_trace()``: every collective and point-to-point transfer, with the module that
  issued it, as a per-module tree (``print(t)``) or a Chrome/Perfetto trace;
- ``visualize(x)``: which rank holds which block of a DTensor;
- ``check_replicas(model)``: that what is claimed replicated is bitwise equal;
- ``detect_anomaly()``: the first op, module and rank that produced NaN/Inf;
- ``cache_sizes()``: the engine's bounded caches;
- ``vescale.explain`` (in the top-level namespace): why an op moved what it moved.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch.distributed as dist

from . import _C
from ._trace import collective_finished, collective_started, record_collective

__all__ = ["fallback_counts", "fallback_report", "reset_fallback_counts", "cache_misses", "clear_cache",
           "debug_mode", "collective_failure_note", "collective_counts", "reset_collective_counts",
           "comm_trace", "CommTrace", "merge_chrome_traces", "visualize", "check_replicas", "ReplicaMismatchError",
           "detect_anomaly", "AnomalyError", "cache_sizes", "set_decision_cache_limit",
           "collective_started", "collective_finished", "record_collective"]


def fallback_counts() -> dict[str, int]:
    """Calls per op that had no sharding rule and ran on gathered (replicated) inputs."""
    return {op: count for op, count, _ in _C.fallback_report() if count}


def fallback_report() -> list[tuple[str, int, str]]:
    """(op, calls, reason) for every op that has used the fallback since start-up."""
    return sorted(_C.fallback_report())


def reset_fallback_counts() -> None:
    _C.reset_fallback_counts()


def collective_counts() -> dict[str, tuple[int, int]]:
    """Collectives the engine issued in this process since start-up or the last reset,
    per kind: {"all_gather": (calls, input bytes), ...}. Counts the engine's collectives
    (the redistributions DTensor ops need), not the torch.distributed calls of DDP/ZeRO
    buckets or the pipeline's sends."""
    return {kind: tuple(v) for kind, v in _C.collective_counts().items()}


def reset_collective_counts() -> None:
    _C.reset_collective_counts()


def cache_sizes() -> dict[str, int]:
    """The sizes of the engine's global caches, which are bounded:

    - ``decisions``: cached sharding decisions, all threads together; each thread's
      cache is cleared when it reaches ``decision_limit`` entries (``decision_evictions``
      counts those clears), so shapes that change every step cost recomputed decisions,
      not memory;
    - ``specs``: interned tensor specs that are alive (held by a DTensor or a cached
      decision); the table holds them weakly, and ``spec_table`` (its entries before this
      call dropped the dead ones) stays within ``2 * specs + spec_sweep_min``.
    """
    return dict(_C.cache_sizes())


def set_decision_cache_limit(limit: int | None) -> None:
    """Sets how many decisions each thread caches before its cache is cleared (None: the
    default). A step whose distinct op calls exceed it recomputes decisions every step."""
    _C.set_decision_cache_limit(_C.default_decision_cache_limit() if limit is None else int(limit))


def cache_misses() -> int:
    """How many sharding decisions have been computed; a warm loop adds none."""
    return _C.cache_misses()


def clear_cache() -> None:
    _C.clear_cache()


# ---- collectives -----------------------------------------------------------------------------

def debug_mode() -> None:
    """Checks, before each collective, that every rank of its group issues the same one.

    Ranks that disagree (a data-dependent shape on one rank, or one rank taking another
    code path) then fail at once with "Detected mismatch between collectives on ranks",
    naming each rank's collective and shapes, instead of hanging or exchanging data of
    the wrong size. This is torch's TORCH_DISTRIBUTED_DEBUG=DETAIL: each process group
    created afterwards is wrapped in a checker that runs a barrier and an exchange of
    fingerprints before every collective (slow: for debugging only). Call it before
    any process group is created (before init_device_mesh), or set VESCALE_DEBUG=1.

    Not checked (torch 2.13): all-gathers that vescale's engine issues (Shard ->
    Replicate), because torch's checker forwards the functional all-gather unchecked;
    when only one rank is in such an all-gather, the other rank's check fails after the
    collective timeout instead, and names the rank it waited for.
    """
    if dist.is_initialized():
        warnings.warn("vescale.debug_mode(): process groups created before this call are not checked; "
                      "call it (or set VESCALE_DEBUG=1) before init_device_mesh", stacklevel=2)
    dist.set_debug_level(dist.DebugLevel.DETAIL)


_TIMED_OUT = ("Timed out waiting", "failed to pass monitoredBarrier", "Watchdog caught collective operation timeout")
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


def collective_failure_note(error: BaseException) -> str | None:
    """What an error raised by a collective means for a training job, or None when it
    is not such an error: a timeout or a lost connection almost always means that
    another rank failed, and that rank's log has the cause."""
    from .device_mesh import collective_timeout

    text = str(error)
    if any(s in text for s in _TIMED_OUT):
        return (f"vescale: a collective timed out (vescale's collective timeout: "
                f"{collective_timeout().total_seconds():g} s): another rank probably failed, or is stuck in "
                "another collective; see the other ranks' logs. VESCALE_COLLECTIVE_TIMEOUT (seconds) or "
                "init_device_mesh(timeout=...) sets the timeout; vescale.debug_mode() reports ranks that issue "
                "different collectives.")
    if any(s in text for s in _PEER_LOST):
        return ("vescale: a collective lost its connection to another rank, which probably failed (crashed or "
                "was killed): see that rank's log.")
    return None


def install_failure_notes() -> None:
    """Adds collective_failure_note to the report of an uncaught exception (once per process)."""
    previous = sys.excepthook
    if getattr(previous, "_vescale", False):
        return

    def hook(kind, value, tb):
        note = collective_failure_note(value) if value is not None else None
        if note and note not in getattr(value, "__notes__", ()):
            value.add_note(note)
        previous(kind, value, tb)

    hook._vescale = True
    sys.excepthook = hook


if os.environ.get("VESCALE_DEBUG", "") not in ("", "0"):
    debug_mode()


# ---- communication traces and NaN/Inf localisation (vescale/_comm_trace.py) -------------------

from ._comm_trace import AnomalyError, CommTrace, comm_trace, detect_anomaly, merge_chrome_traces  # noqa: E402
from ._simulated import CollectiveMismatch, SimulatedDeadlock, simulate  # noqa: E402


# ---- which rank holds what ---------------------------------------------------------------------

def _box_str(box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes)) + "]"


def layout(x) -> str:
    """The text ``visualize`` prints."""
    import itertools

    import torch

    from .dtensor import DTensor, _shard_parts, to_c

    if not isinstance(x, DTensor):
        kind = "a plain torch.Tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise TypeError(f"vescale.debug.visualize expects a DTensor, got {kind}; make one with "
                        "vescale.distribute_tensor(x, mesh, placements) or DTensor.from_local(local, mesh, "
                        "placements)")
    mesh, placements, shape = x.device_mesh, tuple(x.placements), list(x.shape)
    cp = to_c(placements)
    names = mesh.mesh_dim_names
    dims = ", ".join(f"{names[m] if names else m}={mesh.size(m)}" for m in range(mesh.ndim))
    lines = [f"DTensor of shape {tuple(shape)} ({str(x.dtype).replace('torch.', '')}) on a {mesh.device_type} mesh "
             f"({dims}), placements {placements}"]
    partial = [(m, p) for m, p in enumerate(placements) if p.is_partial()]
    if partial:
        lines.append("  Partial on " + ", ".join(
            f"mesh dim {m}: the {p.reduce_op}-reduction over its ranks of their values is the tensor"
            for m, p in partial))
    holders: dict[tuple, list[int]] = {}
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        rank = mesh.rank_at(coordinate)
        parts = _shard_parts(shape, mesh, cp, coordinate)
        boxes = [g for _, g in parts if g.numel() > 0 or not shape]
        text = " + ".join(_box_str(b) for b in boxes) if boxes else "nothing (an empty shard)"
        note = " (a partial value)" if partial else ""
        lines.append(f"  rank {rank} at {tuple(coordinate)}: {text}{note}")
        for b in boxes:
            holders.setdefault((b.offsets, b.sizes), []).append(rank)
    if 1 <= len(shape) <= 2 and holders:
        lines.extend(_grid(shape, holders))
    return "\n".join(lines)


def _grid(shape: list[int], holders: dict) -> list[str]:
    """A table of the blocks of a 1-d or 2-d tensor, each cell naming the ranks that hold it."""
    rows_at = sorted({0, shape[0]} | {o[0] for o, _ in holders} | {o[0] + s[0] for o, s in holders})
    cols_at = ([0, 1] if len(shape) == 1 else
               sorted({0, shape[1]} | {o[1] for o, _ in holders} | {o[1] + s[1] for o, s in holders}))

    def who(r0, r1, c0, c1):
        ranks = []
        for (off, size), rs in holders.items():
            box_r = (off[0], off[0] + size[0])
            box_c = (0, 1) if len(shape) == 1 else (off[1], off[1] + size[1])
            if box_r[0] <= r0 and r1 <= box_r[1] and box_c[0] <= c0 and c1 <= box_c[1]:
                ranks.extend(rs)
        ranks = sorted(set(ranks))
        return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(map(str, ranks)) if ranks else "-"

    col_spans = list(zip(cols_at, cols_at[1:]))
    row_spans = list(zip(rows_at, rows_at[1:]))
    header = ["rows \\ cols"] + ([":"] if len(shape) == 1 else [f"{c0}:{c1}" for c0, c1 in col_spans])
    table = [header] + [[f"{r0}:{r1}"] + [who(r0, r1, c0, c1) for c0, c1 in col_spans] for r0, r1 in row_spans]
    widths = [max(len(row[k]) for row in table) for k in range(len(header))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]


def visualize(x, *, file=None) -> None:
    """Prints which rank holds which block of the DTensor ``x``: per rank (and mesh
    coordinate) the index ranges of its block per tensor dim (several blocks under an
    InterleavedShard), a note for Partial placements (every rank holds a whole-shaped
    partial value), and for 1-d and 2-d tensors a table of blocks and their holders.
    Reads only metadata: no communication, so it works from a breakpoint on one rank."""
    print(layout(x), file=file if file is not None else sys.stdout)


# ---- replicas that should be equal -------------------------------------------------------------

class ReplicaMismatchError(RuntimeError):
    """Tensors claimed replicated differ across the ranks that replicate them."""


def _named_tensors(obj):
    import torch
    import torch.nn as nn

    if isinstance(obj, nn.Module):
        seen = set()
        for name, t in list(obj.named_parameters()) + list(obj.named_buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                yield name, t
    elif isinstance(obj, torch.Tensor):
        yield "tensor", obj
    elif isinstance(obj, dict):
        for name, t in obj.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"check_replicas: {name!r} is a {type(t).__name__}, not a tensor")
            yield str(name), t
    elif isinstance(obj, (list, tuple)):
        for i, t in enumerate(obj):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"check_replicas: item {i} is a {type(t).__name__}, not a tensor")
            yield f"[{i}]", t
    else:
        raise TypeError(f"check_replicas takes a module, a tensor, or a dict or list of tensors; got "
                        f"{type(obj).__name__}")


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so every position weighs differently


def _checksum(local):
    """Two 64-bit sums over the tensor's bytes (the second weighted by position): equal
    for bitwise equal tensors, different for almost any change. Integer sums wrap, so
    they do not depend on the order of the reduction."""
    import torch

    b = local.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int64)
    weights = torch.arange(w.numel(), dtype=torch.int64, device=w.device) * 2 + 1
    return torch.stack([w.sum(), (w * (weights * _MIX)).sum()])


def _ddp_groups(obj) -> dict[int, object]:
    """{id(parameter): the DDP group that keeps it replicated} for DDP modules in ``obj``."""
    import torch.nn as nn

    from .parallel.ddp import DDP

    out = {}
    if isinstance(obj, nn.Module):
        for m in obj.modules():
            if isinstance(m, DDP):
                for p in m.module.parameters():
                    out.setdefault(id(p), (m.group, "DDP's data-parallel group"))
    return out


def check_replicas(model_or_tensors, *, group=None, raise_error: bool = True) -> list[str]:
    """Checks that tensors claimed replicated are bitwise equal on every rank that holds
    a replica, and names the first that is not.

    A DTensor is checked along each mesh dim where it is Replicate (its local tensor is
    the same on the ranks of that dim); parameters of a vescale DDP inside a module are
    also checked across DDP's group; plain tensors are checked across ``group`` when one
    is given (a ProcessGroup). Each rank computes two 64-bit checksums per local tensor,
    and one all-gather per group compares them: cheap enough to run every N steps.
    Collective: every rank calls it with the same model. Returns the mismatches (empty
    when all agree); by default the first raises ReplicaMismatchError on every rank.
    Meta, deferred and ZeRO-3-emptied tensors are skipped.
    """
    import torch

    from .dtensor import DTensor
    from ._local import local_of

    if not dist.is_initialized():
        raise RuntimeError("check_replicas compares ranks: initialise torch.distributed (vescale.init_device_mesh) "
                           "first")
    ddp = _ddp_groups(model_or_tensors)
    checks: dict = {}  # group key -> (process group, [(name, what, checksum)])
    for name, t in _named_tensors(model_or_tensors):
        local = local_of(t)
        if local.is_meta or (local.numel() > 0 and local.untyped_storage().nbytes() == 0):
            continue
        claims = []
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            for m, p in enumerate(t.placements):
                if p.is_replicate() and mesh.size(m) > 1:
                    label = mesh.mesh_dim_names[m] if mesh.mesh_dim_names else str(m)
                    claims.append(((id(mesh), m), mesh.get_group(m), f"Replicate on mesh dim {label} of {mesh}"))
        if id(t) in ddp:
            pg, what = ddp[id(t)]
            claims.append((("pg", id(pg)), pg, what))
        elif group is not None and not isinstance(t, DTensor):
            claims.append((("pg", id(group)), group, "the given group"))
        if claims:
            digest = _checksum(local)
            for key, pg, what in claims:
                checks.setdefault(key, (pg, []))[1].append((name, what, digest))
    mismatches = []
    for pg, items in checks.values():
        mine = torch.stack([d for _, _, d in items])
        size = dist.get_world_size(pg)
        everyone = torch.empty((size * mine.shape[0],) + tuple(mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(everyone, mine, group=pg)
        everyone = everyone.view((size,) + tuple(mine.shape))
        ranks = dist.get_process_group_ranks(pg)
        for k, (name, what, _) in enumerate(items):
            values: dict[tuple, list[int]] = {}
            for j in range(size):
                values.setdefault(tuple(everyone[j, k].tolist()), []).append(ranks[j])
            if len(values) > 1:
                split = " vs ".join(("ranks " if len(rs) > 1 else "rank ") + ", ".join(map(str, rs))
                                    for rs in sorted(values.values(), key=lambda rs: rs[0]))
                mismatches.append(f"{name!r} ({what}) differs across ranks: {split} hold different values")
    if raise_error:
        # Ranks outside the group that differs learn of it too, and all raise alike.
        reports = [None] * dist.get_world_size()
        flag = torch.tensor([1 if mismatches else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]):
            dist.all_gather_object(reports, mismatches[0] if mismatches else None)
            first = next(r for r in reports if r is not None)
            raise ReplicaMismatchError(f"vescale.debug.check_replicas: {first} (silent divergence: check for "
                                       "rank-dependent randomness, a non-deterministic kernel, or an update "
                                       "applied on some ranks only)")
    return mismatches
