"""All ranks in one process: ``vescale.debug.simulate(fn, world_size=N)`` runs ``fn`` as N
simulated ranks, threads of this process, one at a time (see scheduler.py), over a
torch.distributed backend of plain tensor copies (group.py). Inside ``fn`` the program is
the one torchrun would run: ``dist.get_rank()``, device meshes, DTensors, DDP, ZeRO,
pipelines. ``breakpoint()`` stops every rank at one point (debugger.py)."""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from .debugger import Rendezvous
from .group import BACKEND, CollectiveMismatch, SimulatedGroup, World
from .scheduler import PerRankState, Scheduler, SimulatedDeadlock

__all__ = ["simulate", "SimulatedDeadlock", "CollectiveMismatch", "BACKEND"]

_current: World | None = None  # the run in progress (one at a time)


def _create_group(store, rank: int, size: int, timeout):
    if _current is None:
        raise RuntimeError(f"the {BACKEND!r} backend exists only inside vescale.debug.simulate(...)")
    return SimulatedGroup(_current, rank, size)


def _register_backend() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])


def _per_rank_globals() -> list[tuple[object, str]]:
    """vescale's module globals that belong to one rank (one process under torchrun)."""
    from .. import device_mesh
    from ..autoplan import commfit
    from ..checkpoint import agreement as checkpoint_agreement
    return [(device_mesh, "_global_mesh"), (device_mesh, "_timeout"), (checkpoint_agreement, "_group"),
            (commfit, "_burst_x")]


def simulate(fn: Callable[..., Any], *, world_size: int, args: tuple = (), kwargs: dict | None = None,
             debugger_stdin=None, debugger_stdout=None) -> list:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` simulated ranks in this process and
    returns each rank's result, in rank order.

    The default process group is set up before ``fn`` starts (backend ``"vescale_sim"``,
    CPU tensors); ``fn`` builds its meshes and models as under torchrun. Ranks run one at a
    time and switch only where one waits for another, so a run is deterministic; each
    rank has torch's default generator, Python's ``random`` and vescale's global mesh to
    itself. A rank that fails makes ``simulate`` raise its exception (the others'
    ``SimulatedDeadlock`` waiting for it is dropped); ranks that wait for each other
    forever raise ``SimulatedDeadlock`` naming what each waits for, where torchrun would
    hang. ``breakpoint()`` in ``fn`` opens pdb with every rank stopped at the same place;
    ``ranks EXPR`` at its prompt evaluates EXPR on all of them. ``debugger_stdin`` /
    ``debugger_stdout`` replace the terminal for pdb (scripted sessions, tests)."""
    global _current
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if _current is not None:
        raise RuntimeError("vescale.debug.simulate is already running in this process (runs do not nest)")
    if dist.is_initialized():
        raise RuntimeError("vescale.debug.simulate runs a world of its own, but torch.distributed is already "
                           "initialised in this process; call it from a plain `python` process, not under torchrun")
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    _register_backend()
    launcher_state = PerRankState(_per_rank_globals())
    saved = launcher_state.capture()
    scheduler = Scheduler(world_size, launcher_state)
    world = World(scheduler)
    rendezvous = Rendezvous(scheduler, debugger_stdin, debugger_stdout)
    store = dist.HashStore()
    results: list = [None] * world_size
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        error = None
        try:
            scheduler.enter(rank)
            dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(*args, **(kwargs or {}))
            finally:
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 (reported by simulate, in the caller's thread)
            error = errors[rank] = e
        finally:
            scheduler.leave(rank, error)

    # torch.distributed's default world is process-wide; each rank thread gets its own
    # (torch's own threaded test backend does the same), and so does c10d's registry of
    # group names, which the functional collectives resolve groups through.
    old_world = dist.distributed_c10d._world
    dist.distributed_c10d._world = ThreadLocalWorld()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    old_hook, sys.breakpointhook = sys.breakpointhook, rendezvous.hook
    old_excepthook = sys.excepthook  # init_process_group wraps it to prefix the rank
    _current = world
    threads = [threading.Thread(target=rank_main, args=(r,), name=f"vescale-rank-{r}", daemon=True)
               for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        scheduler.start()
        for t in threads:
            t.join()
    finally:
        _current = None
        sys.breakpointhook = old_hook
        sys.excepthook = old_excepthook
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        dist.distributed_c10d._world = old_world
        launcher_state.restore(saved)
    _raise_first_failure(errors)
    return results


def _raise_first_failure(errors: dict[int, BaseException]) -> None:
    """A rank's own error outranks the deadlocks of the ranks that waited for it."""
    if not errors:
        return
    own = {r: e for r, e in errors.items() if not isinstance(e, SimulatedDeadlock)}
    rank, error = min((own or errors).items())
    error.add_note(f"(on simulated rank {rank} of vescale.debug.simulate)")
    raise error
