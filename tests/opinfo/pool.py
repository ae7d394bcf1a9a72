"""Gloo ranks that the parent drives one message at a time, and that it can afford to lose.

A bad op may leave the ranks out of step (one raised before a collective that the others
wait in), kill a rank (a crash in C++), or spin. The parent waits for every rank's answer:
once one rank has answered, the others get a short grace, since after their last common
collective ranks finish within moments of each other. Whenever the ranks can no longer be
trusted they are killed and started afresh, and the message counts as a "hang" or a "crash".
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
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
    kind: str                                      # ok | hang | crash
    values: dict = field(default_factory=dict)     # rank -> its answer (all ranks when ok)
    message: str = ""


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn, gloo_timeout_s: float, handler: str, log_path: str) -> None:
    with open(log_path, "a") as f:  # C++ warnings, a crash's last words: one file per rank
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    faulthandler.register(signal.SIGUSR1)  # the parent asks where a hung rank waits
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
    except (OSError, AttributeError):
        pass
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
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
    while (msg := conn.recv()) is not None:
        try:
            conn.send(("ok", handle(msg)))
        except BaseException:  # noqa: BLE001  (the parent decides what it means)
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    """``world`` processes that run ``handler`` ("module:function") on every message."""

    def __init__(self, world: int, handler: str, *, gloo_timeout_s: float = 60, grace_s: float = 15):
        self.world, self.handler = world, handler
        self.gloo_timeout_s, self.grace_s = gloo_timeout_s, grace_s
        self.log_dir = tempfile.mkdtemp(prefix="opinfo-ranks-")
        self._procs: list = []
        self._conns: list = []

    def start(self, attempts: int = 4) -> None:
        """A failed start (say, the extension being rebuilt just then) is retried."""
        for attempt in range(attempts):
            try:
                return self._start()
            except RuntimeError as e:
                if attempt == attempts - 1:
                    raise
                log(f"{e}; retrying in 30s")
                time.sleep(30)

    def _start(self) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"  # read by the children's torch at import
        # One hash seed for all ranks: Python code that picks among equal choices by iterating
        # a set (torch's DTensor does) then picks alike everywhere. With a seed per process, as
        # torchrun leaves it, ranks can choose different collectives and hang.
        os.environ["PYTHONHASHSEED"] = os.environ.get("OPINFO_HASHSEED", "0")
        ctx, port = mp.get_context("spawn"), _free_port()
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            self._procs.append(ctx.Process(target=_worker, daemon=True, args=(
                rank, self.world, port, child, self.gloo_timeout_s, self.handler, self.log_path(rank))))
            self._procs[-1].start()
            child.close()
            self._conns.append(parent)
        for rank, conn in enumerate(self._conns):
            try:
                if conn.poll(300) and conn.recv() == "ready":
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
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        for proc in self._procs:  # at once: ranks out of step would only wait out their timeout
            if proc.is_alive():
                proc.kill()
        self.stop()
        self.start()

    def call(self, msg, timeout_s: float) -> Reply:
        """Sends ``msg`` to every rank; after a hang or a crash the ranks are restarted."""
        try:
            for conn in self._conns:
                conn.send(msg)
        except OSError:
            return self._lost(Reply("crash", message="a rank was gone before the message was sent"))
        answers: dict = {}
        started = time.monotonic()
        deadline = started + timeout_s
        while len(answers) < self.world:
            waiting = [r for r in range(self.world) if r not in answers]
            for conn in mp.connection.wait([self._conns[r] for r in waiting], timeout=1.0):
                try:
                    answers[self._conns.index(conn)] = conn.recv()
                except (EOFError, OSError):
                    pass  # the process died: seen below
            waiting = [r for r in range(self.world) if r not in answers]
            dead = [r for r in waiting if not self._procs[r].is_alive()]
            if dead:
                codes = "; ".join(f"rank {r} exit code {self._procs[r].exitcode}: {self.last_words(r)}" for r in dead)
                return self._lost(Reply("crash", self._ok(answers), codes))
            if waiting and time.monotonic() > deadline:
                return self._lost(Reply("hang", self._ok(answers), f"ranks {waiting} gave no answer in "
                                        f"{time.monotonic() - started:.0f}s; rank {waiting[0]} was at "
                                        f"{self.where(waiting[0])}"))
            if answers and deadline - time.monotonic() > self.grace_s:
                deadline = time.monotonic() + self.grace_s  # the others should be moments behind
        errors = {r: a[1] for r, a in answers.items() if a[0] == "error"}
        if errors:
            r = min(errors)
            return self._lost(Reply("crash", message=f"rank {r} raised outside the checks: "
                                                     f"{errors[r].strip().splitlines()[-1][:300]}"))
        return Reply("ok", self._ok(answers))

    @staticmethod
    def _ok(answers: dict) -> dict:
        return {r: a[1] for r, a in answers.items() if a[0] == "ok"}

    def _lost(self, reply: Reply) -> Reply:
        self.restart()
        return reply

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank{rank}.log")

    def last_words(self, rank: int) -> str:
        try:
            with open(self.log_path(rank), errors="replace") as f:
                lines = [ln.strip() for ln in f.readlines()[-20:] if ln.strip() and "Warning" not in ln]
        except OSError:
            return ""
        return " / ".join(lines[-2:])[-300:]

    def where(self, rank: int) -> str:
        """The innermost Python frames of a live rank (faulthandler writes them to its log)."""
        os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(1)
        with open(self.log_path(rank), errors="replace") as f:
            dump = f.read().rsplit("(most recent call first):", 1)[-1]
        frames = [ln.strip()[5:] for ln in dump.splitlines() if ln.strip().startswith("File")][:3]
        return " <- ".join(f.replace(os.getcwd() + "/", "") for f in frames)
