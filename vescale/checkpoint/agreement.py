"""How the ranks of a checkpoint's save or load stay together: a process group of the
checkpoint's own, and one collective after each step that can fail on some ranks only,
so that every rank either goes on or raises the same error (a rank that went on alone
would change its state while the others do not, or wait for them forever)."""

from __future__ import annotations

import torch.distributed as dist

from ..device_mesh import collective_timeout, of_this_world, release_at_exit
from .storage import CorruptCheckpoint

# A process group of its own, so that a background save never mixes with training
# collectives: (the world it was made in, the group), as device_mesh.of_this_world keeps it.
_group: tuple | None = None


def _forget_group() -> None:
    global _group
    _group = None


release_at_exit(_forget_group)


def _checkpoint_group():
    """The checkpoint's process group; None in a process without torch.distributed,
    which then saves and loads alone."""
    global _group
    if not dist.is_initialized():
        return None
    # torch's default timeout would be 30 minutes
    _group = of_this_world(_group, lambda: dist.new_group(backend="gloo", timeout=collective_timeout()))
    return _group[1]


def _rank_world(group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _all_gather(obj, group) -> list:
    if group is None:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# the errors that every rank raises as they are; any other becomes a RuntimeError naming it
_SHARED_ERRORS = {c.__name__: c for c in (CorruptCheckpoint, ValueError, TypeError, FileNotFoundError, OSError,
                                           PermissionError, FileExistsError, NotADirectoryError, IsADirectoryError)}


def _agree(group, error: Exception | None, outcome: str, same=None) -> None:
    """One collective in which the ranks tell each other what went wrong: then all go on,
    or all raise the same error, naming the first rank that found one (a rank going on
    alone would change its state while the others do not, or wait for them forever).
    ``same``: what every rank must have found alike (which checkpoint it read)."""
    gathered = _all_gather((None if error is None else (type(error).__name__, str(error)), same), group)
    reports = [report for report, _ in gathered]
    failed = [r for r, report in enumerate(reports) if report is not None]
    if not failed and any(s != gathered[0][1] for _, s in gathered):
        seen = ", ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(gathered))
        raise ValueError(f"the ranks read different checkpoints ({seen}): they see the file system differently "
                         f"(a copy on each machine? a save that crashed between its two renames, seen by some "
                         f"ranks only?); {outcome}")
    if not failed:
        return
    kind, message = reports[failed[0]]
    also = f"; ranks {', '.join(map(str, failed[1:]))} failed too" if len(failed) > 1 else ""
    cls = _SHARED_ERRORS.get(kind)
    raise (cls or RuntimeError)(f"{message if cls else f'{kind}: {message}'} "
                                f"[found by rank {failed[0]}{also}; {outcome}]") from error
