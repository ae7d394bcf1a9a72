"""Introspection of the engine: which ops ran through the replicate fallback, and
how often sharding decisions were computed (cache misses)."""

from __future__ import annotations

from . import _C

__all__ = ["fallback_counts", "fallback_report", "reset_fallback_counts", "cache_misses", "clear_cache"]


def fallback_counts() -> dict[str, int]:
    """Calls per op that had no sharding rule and ran on gathered (replicated) inputs."""
    return {op: count for op, count, _ in _C.fallback_report() if count}


def fallback_report() -> list[tuple[str, int, str]]:
    """(op, calls, reason) for every op that has used the fallback since start-up."""
    return sorted(_C.fallback_report())


def reset_fallback_counts() -> None:
    _C.reset_fallback_counts()


def cache_misses() -> int:
    """How many sharding decisions have been computed; a warm loop adds none."""
    return _C.cache_misses()


def clear_cache() -> None:
    _C.clear_cache()
