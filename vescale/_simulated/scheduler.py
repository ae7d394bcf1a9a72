"""Which simulated rank runs now: exactly one rank thread at a time (it holds the baton),
handed on only when the running rank has to wait (a collective the others have not
joined, a recv with no message yet, a breakpoint). One rank at a time makes a simulated
run deterministic, and lets process-wide state that a real rank would own alone (torch's
default generator, Python's ``random``, a few module globals) be saved and restored at
each hand-over, as if every rank were its own process."""

from __future__ import annotations

import random
import threading
from typing import Callable

import torch


class SimulatedDeadlock(RuntimeError):
    """Every simulated rank waits for another: the run can never go on (under torchrun it
    would hang until the collective timeout)."""


class PerRankState:
    """Process-wide state a real rank owns alone: the generators, and module globals
    (``(module, name)`` pairs) such as vescale's global device mesh."""

    def __init__(self, module_globals: list[tuple[object, str]]):
        self._globals = module_globals

    def fresh(self) -> tuple:
        # A fresh process: torch's default seed; Python's random as the launcher had it.
        return (torch.Generator().get_state(), random.getstate(), [None] * len(self._globals))

    def capture(self) -> tuple:
        return (torch.get_rng_state(), random.getstate(), [getattr(m, n) for m, n in self._globals])

    def restore(self, state: tuple) -> None:
        torch_rng, py_rng, values = state
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        for (m, n), v in zip(self._globals, values):
            setattr(m, n, v)


class Scheduler:
    def __init__(self, world_size: int, state: PerRankState):
        self.world_size = world_size
        self._cv = threading.Condition()
        self._running: int | None = None
        self._done = [False] * world_size
        self._failed: dict[int, BaseException] = {}
        # What each waiting rank waits for: (is it ready?, what to say of it in a deadlock).
        self._waits: list[tuple[Callable[[], bool], Callable[[], str]] | None] = [None] * world_size
        self._deadlock: str | None = None
        self._state = state
        self._saved = [state.fresh() for _ in range(world_size)]
        self._local = threading.local()
        # Ranks that are evaluating a debugger command: a deadlock they cause fails only them.
        self.interactive: set[int] = set()
        self._command_failure: str | None = None
        self.command_id = 0

    # -- the rank threads -----------------------------------------------------------

    def rank(self) -> int | None:
        """The simulated rank of the calling thread (None outside the rank threads)."""
        return getattr(self._local, "rank", None)

    def enter(self, rank: int) -> None:
        """First call of a rank thread: waits for the baton."""
        self._local.rank = rank
        with self._cv:
            self._cv.wait_for(lambda: self._running == rank)
            self._state.restore(self._saved[rank])

    def leave(self, rank: int, error: BaseException | None) -> None:
        """Last call of a rank thread: hands the baton on for good."""
        with self._cv:
            self._done[rank] = True
            if error is not None and not isinstance(error, SimulatedDeadlock):
                self._failed[rank] = error
            if self._running == rank:
                self._hand_over(rank)

    def start(self) -> None:
        with self._cv:
            self._running = 0
            self._cv.notify_all()

    def wait_until(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Lets the other ranks run until ``ready()``; raises SimulatedDeadlock when no
        rank can ever make it true."""
        r = self.rank()
        with self._cv:
            self._raise_if_stuck(r)
            if ready():
                return
            self._waits[r] = (ready, what)
            try:
                while not ready():
                    self._hand_over(r)
                    self._cv.wait_for(lambda: self._running == r or self._deadlock is not None)
                    self._raise_if_stuck(r)
            finally:
                self._waits[r] = None
            self._state.restore(self._saved[r])

    def _raise_if_stuck(self, r: int) -> None:
        if self._deadlock is not None:
            raise SimulatedDeadlock(self._deadlock)
        if self._command_failure is not None and r in self.interactive:
            self._state.restore(self._saved[r])
            raise SimulatedDeadlock(self._command_failure)

    def others_stopped(self, r: int) -> bool:
        """Whether every rank but ``r`` has finished or waits for something not yet there."""
        return all(self._done[s] or (self._waits[s] is not None and not self._waits[s][0]())
                   for s in range(self.world_size) if s != r)

    def waiting_for(self, s: int) -> str:
        if self._done[s]:
            return "finished"
        wait = self._waits[s]
        return f"waits in {wait[1]()}" if wait is not None else "running"

    def begin_command(self, rank: int) -> None:
        """A debugger command starts on ``rank``: its collectives are the command's own."""
        with self._cv:
            self.command_id += 1
            self.interactive = {rank}

    def end_command(self) -> None:
        """A debugger command is over: its ranks are the program's again."""
        with self._cv:
            self.interactive.clear()
            self._command_failure = None

    # -- hand-over ------------------------------------------------------------------

    def _runnable(self, s: int) -> bool:
        if self._done[s]:
            return False
        if self._command_failure is not None and s in self.interactive:
            return True  # it raises as soon as it runs
        wait = self._waits[s]
        return wait is None or wait[0]()

    def _hand_over(self, r: int) -> None:
        """Called with the lock held by the running rank ``r``."""
        self._saved[r] = self._state.capture()
        if self._pass_to_next(r):
            return
        if all(self._done):
            return
        message = self._deadlock_message()
        if self.interactive:
            # A debugger command that cannot complete: the ranks evaluating it fail, one
            # after the other; the program's ranks stay where they were.
            self._command_failure = message + "\n(the command fails; the program stays where it was)"
            self._pass_to_next(r)
            return
        self._deadlock = message
        self._cv.notify_all()

    def _pass_to_next(self, r: int) -> bool:
        n = self.world_size
        for k in range(1, n + 1):
            s = (r + k) % n
            if self._runnable(s):
                self._running = s
                self._cv.notify_all()
                return True
        self._running = None
        return False

    def _deadlock_message(self) -> str:
        lines = ["simulated ranks deadlocked: every rank waits for another"]
        for s in range(self.world_size):
            if s in self._failed:
                e = self._failed[s]
                lines.append(f"  rank {s}: failed with {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            elif self._done[s]:
                lines.append(f"  rank {s}: finished")
            elif self._waits[s] is not None:
                lines.append(f"  rank {s}: waits in {self._waits[s][1]()}")
        return "\n".join(lines)
