"""Introspection of the engine: which ops ran through the replicate fallback, and
how often sharding decisions were computed (cache misses); checks of the collectives
ranks issue (``debug_mode``), and a note on errors raised because another rank failed."""

from __future__ import annotations

import os
import sys
import warnings

import torch.distributed as dist

from . import _C

__all__ = ["fallback_counts", "fallback_report", "reset_fallback_counts", "cache_misses", "clear_cache",
           "debug_mode", "collective_failure_note", "collective_counts", "reset_collective_counts"]


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
