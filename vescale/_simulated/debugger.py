"""``breakpoint()`` inside simulated ranks. The first rank to reach a breakpoint waits
until every other rank has reached it too (or finished, or waits for something the
stopped rank has not done yet), then opens pdb on its own frame. The other ranks stay
parked at their breakpoint until pdb resumes, so the whole world is stopped at one point
of the program and can be looked at: ``ranks EXPR`` evaluates EXPR on every parked rank,
each on its own thread and in its own frame, so collectives inside EXPR
(``x.full_tensor()``) work as in the program, and prints the results rank by rank."""

from __future__ import annotations

import pdb
import sys
from types import FrameType

from .scheduler import Scheduler


class Rendezvous:
    def __init__(self, scheduler: Scheduler, stdin=None, stdout=None):
        self.scheduler = scheduler
        self.stdin, self.stdout = stdin, stdout
        self.parked: dict[int, FrameType] = {}
        self.leader: int | None = None
        self.generation = 0
        self.requests: dict[int, tuple[str, int]] = {}
        self.results: dict[int, str] = {}
        self.previous_hook = sys.breakpointhook

    def hook(self, *args, **kwargs):
        """sys.breakpointhook while simulated ranks run."""
        sched = self.scheduler
        r = sched.rank()
        if r is None:  # not a rank thread
            return self.previous_hook(*args, **kwargs)
        frame = sys._getframe(1)
        self.parked[r] = frame
        generation = self.generation
        if self.leader is None:
            self.leader = r
            sched.wait_until(lambda: sched.others_stopped(r),
                             lambda: "breakpoint() (for the other ranks to reach theirs)")
            debugger = RankDebugger(self, r)
            debugger.set_trace(frame)  # pdb stops at the next line of `frame`
            return None
        while True:  # parked: answer the leader's `ranks` commands until it resumes
            sched.wait_until(lambda: self.generation != generation or r in self.requests,
                             lambda: f"breakpoint() (parked; rank {self.leader} has the debugger)")
            if self.generation != generation:
                return None
            source, depth = self.requests.pop(r)
            self.results[r] = self.evaluate(r, source, _up(frame, depth))

    def evaluate(self, r: int, source: str, frame: FrameType) -> str:
        try:
            value = eval(compile(source, "<ranks>", "eval"), frame.f_globals, frame.f_locals)  # noqa: S307 (the user's own debugger input)
            text = repr(value)
        except Exception as e:  # noqa: BLE001 (shown to the user, as pdb does)
            text = f"*** {type(e).__name__}: {e}"
        finally:
            self.scheduler.interactive.discard(r)
        return text

    def release(self) -> None:
        """pdb resumed: the parked ranks go on."""
        if self.leader is None:
            return
        self.parked.clear()
        self.leader = None
        self.generation += 1


def _up(frame: FrameType, depth: int) -> FrameType:
    for _ in range(depth):
        if frame.f_back is None:
            break
        frame = frame.f_back
    return frame


def _depth(bottom: FrameType, frame: FrameType) -> int:
    depth, f = 0, bottom
    while f is not None and f is not frame:
        f, depth = f.f_back, depth + 1
    return depth if f is frame else 0


class RankDebugger(pdb.Pdb):
    def __init__(self, rendezvous: Rendezvous, rank: int):
        super().__init__(stdin=rendezvous.stdin, stdout=rendezvous.stdout)
        if rendezvous.stdin is not None:
            self.use_rawinput = False
        self.rendezvous, self.rank = rendezvous, rank
        self.session = rendezvous.generation  # the stop this debugger was opened for
        self.prompt = f"(Pdb rank {rank}) "

    def interaction(self, frame, tb):
        try:
            super().interaction(frame, tb)
        finally:
            if self.rendezvous.generation == self.session:  # not a later stop another rank leads
                self.rendezvous.release()

    def onecmd(self, line: str):
        sched = self.rendezvous.scheduler
        sched.begin_command(self.rank)
        try:
            return super().onecmd(line)
        finally:
            sched.end_command()

    def do_ranks(self, arg: str):
        """ranks EXPR
        Evaluate EXPR on every rank stopped at this breakpoint (each in its own frame, the
        same number of levels up as the current one; collectives work) and print the
        results rank by rank."""
        rv, sched = self.rendezvous, self.rendezvous.scheduler
        if not arg.strip():
            self.error("usage: ranks EXPR")
            return
        parked = sorted(rv.parked)
        if self.rank not in rv.parked:
            self.error("the other ranks are no longer stopped here (ranks works at the breakpoint itself, "
                       "before next/step/continue)")
            return
        depth = _depth(rv.parked[self.rank], self.curframe)
        rv.results.clear()
        sched.interactive.update(parked)
        for s in parked:
            if s != self.rank:
                rv.requests[s] = (arg, depth)
        rv.results[self.rank] = rv.evaluate(self.rank, arg, self.curframe)
        sched.wait_until(lambda: all(s in rv.results for s in parked),
                         lambda: "the parked ranks to evaluate a debugger command")
        for s in range(sched.world_size):
            shown = rv.results[s] if s in rv.results else f"not at this breakpoint ({sched.waiting_for(s)})"
            self.message(f"[rank {s}] {shown}")
