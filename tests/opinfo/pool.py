"""Gloo ranks that the parent drives one message at a time, and that it can afford to lose.

A bad op may leave the ranks out of step (one raised before a collective that the others
wait in), kill a rank (a crash in C++), or spin forever. The parent waits for every rank's
answer with a deadline; whenever the ranks can no longer be trusted it kills them and
starts fresh ones, and reports what happened as a "hang" or a "crash" of that message.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import ctypes
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta


@dataclass
class Reply:
    kind: str                       # ok | hang | crash
    values: list = field(default_factory=list)   # per-rank return values when ok
    message: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn, gloo_timeout_s: float, handler: str, log_path: str) -> None:
    # The ranks' own output (C++ warnings, a crash's last words) goes to a file per rank.
    with open(log_path, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    faulthandler.register(signal.SIGUSR1)  # the parent asks where a hung rank is waiting
    _die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks share 2 cores; more threads only contend
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=gloo_timeout_s))
    module_name, fn_name = handler.split(":")
    module = importlib.import_module(module_name)
    module.setup()
    handle = getattr(module, fn_name)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            conn.send(("ok", handle(msg)))
        except BaseException:  # noqa: BLE001  (the parent decides what a failure means)
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the parent goes, however it goes."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Ranks:
    """``world`` processes running ``handler`` ("module:function") on every message."""

    def __init__(self, world: int, handler: str, *, gloo_timeout_s: float = 60, start_timeout_s: float = 300):
        self.world, self.handler = world, handler
        self.log_dir = tempfile.mkdtemp(prefix="opinfo-ranks-")
        self.gloo_timeout_s, self.start_timeout_s = gloo_timeout_s, start_timeout_s
        self._procs: list = []
        self._conns: list = []
        self.restarts = 0

    def start(self, attempts: int = 4) -> None:
        """Starts the ranks; a failed start (say, the extension being rebuilt under us) is retried."""
        for attempt in range(attempts):
            try:
                return self._start()
            except RuntimeError as e:
                if attempt == attempts - 1:
                    raise
                log(f"{e}; retrying in 30s")
                time.sleep(30)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the children's torch at import
        # One hash seed for all ranks: Python code that iterates over a set to pick among
        # equal choices (torch's DTensor does) then picks alike on every rank. With a seed
        # per process, as torchrun leaves it, ranks can pick different collectives and hang.
        os.environ["PYTHONHASHSEED"] = os.environ.get("OPINFO_HASHSEED", "0")
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(rank, self.world, port, child, self.gloo_timeout_s, self.handler,
                                     self.log_path(rank)))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        for rank, conn in enumerate(self._conns):
            try:
                if conn.poll(self.start_timeout_s) and conn.recv() == "ready":
                    continue
            except (EOFError, OSError):
                pass
            self.stop()
            raise RuntimeError(f"rank {rank} did not start: {self.last_words(rank)}")

    def stop(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank{rank}.log")

    def last_words(self, rank: int) -> str:
        try:
            with open(self.log_path(rank), errors="replace") as f:
                lines = [ln.strip() for ln in f.readlines()[-20:] if ln.strip() and "Warning" not in ln][-2:]
        except OSError:
            return ""
        return " / ".join(lines)[-300:]

    def where(self, rank: int) -> str:
        """The innermost Python frames of a live rank (faulthandler writes them to its log)."""
        os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(1)
        try:
            with open(self.log_path(rank), errors="replace") as f:
                dump = f.read().rsplit("(most recent call first):", 1)[-1]
        except OSError:
            return "?"
        frames = [ln.strip() for ln in dump.splitlines() if ln.strip().startswith("File")][:3]
        return " <- ".join(f.replace("File ", "").replace(os.getcwd() + "/", "") for f in frames)

    def restart(self) -> None:
        # SIGKILL right away: ranks that are out of step would only wait out their gloo timeout.
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self.stop()
        self.restarts += 1
        self.start()

    def call(self, msg, timeout_s: float) -> Reply:
        """Sends ``msg`` to every rank; on a hang or a crash the ranks are restarted."""
        if not self._procs:
            self.start()
        try:
            for conn in self._conns:
                conn.send(msg)
        except OSError:
            return self._lost("crash", "a rank was gone before the message was sent")
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.world:
            waiting = [r for r in range(self.world) if r not in answers]
            left = deadline - time.monotonic()
            ready = mp.connection.wait([self._conns[r] for r in waiting], timeout=max(0.0, min(left, 1.0)))
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    answers[rank] = conn.recv()
                except (EOFError, OSError):
                    pass  # the process died; reported below
            dead = [r for r in waiting if r not in answers and not self._procs[r].is_alive()]
            if dead:
                codes = ", ".join(f"rank {r} exit code {self._procs[r].exitcode} ({self.last_words(r)})" for r in dead)
                return self._lost("crash", f"{codes} (others: {self._summary(answers)})")
            if time.monotonic() > deadline:
                return self._lost("hang", f"ranks {waiting} gave no answer within {timeout_s:.0f}s "
                                          f"(others: {self._summary(answers)}); rank {waiting[0]} was at "
                                          f"{self.where(waiting[0])}")
        errors = {r: a[1] for r, a in answers.items() if a[0] == "error"}
        if errors:
            rank = min(errors)
            last = errors[rank].strip().splitlines()[-1]
            return self._lost("crash", f"rank {rank} raised outside the checks: {last[:300]}")
        return Reply("ok", [answers[r][1] for r in range(self.world)])

    def _lost(self, kind: str, message: str) -> Reply:
        self.restart()
        return Reply(kind, message=message)

    @staticmethod
    def _summary(answers: dict) -> str:
        return f"{len(answers)} answered" if answers else "none answered"


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)
