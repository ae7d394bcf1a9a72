"""A pool of gloo ranks that live for the whole test session.

Starting processes and process groups costs seconds on two cores, so each world size
gets one pool; a test sends a module-level function to every rank and gets back each
rank's result. If a rank raises, the test fails with that rank's traceback; if the
ranks stop answering (a collective left hanging), the pool is restarted.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

_RESTART_GRACE_S = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# VESCALE_TEST_SLOWDOWN stretches every timeout (ranks run under valgrind, say, through
# the interpreter named by VESCALE_TEST_WORKER_EXECUTABLE).
_SLOWDOWN = float(os.environ.get("VESCALE_TEST_SLOWDOWN", "1"))
_TIMEOUT_S = int(120 * _SLOWDOWN)


def _worker(rank: int, world: int, port: int, conn, path: list[str], stacks_file: str) -> None:
    sys.path[:] = path
    # One thread per rank by default (the ranks share the machine's cores);
    # VESCALE_TEST_THREADS sets another count, to run the tests with other reduction orders.
    threads = os.environ.get("VESCALE_TEST_THREADS", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS=threads,
                      VESCALE_COLLECTIVE_TIMEOUT=str(_TIMEOUT_S),  # the meshes' groups, as the world's
                      # c10d's flight recorder (a ring of the last 2,000 collectives per
                      # process) is off: no test reads its dumps, and the ranks issue
                      # hundreds of thousands of collectives.
                      TORCH_FR_BUFFER_SIZE="0")
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that crashes in C++ says where, instead of vanishing
    # A rank that stops answering is asked where it is (SIGUSR1) before the pool restarts:
    # its Python stacks go to a file the test's report quotes.
    stacks = open(stacks_file, "w")  # noqa: SIM115  (open for the process's life)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    torch.set_num_threads(int(threads))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=_TIMEOUT_S))
    import vescale  # noqa: F401  (registers the engine before any case runs)

    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args, kwargs = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001  (everything goes back to the test)
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list = []
        self._conns: list = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        if os.environ.get("VESCALE_TEST_WORKER_EXECUTABLE"):
            ctx.set_executable(os.environ["VESCALE_TEST_WORKER_EXECUTABLE"])
        port = _free_port()
        self._stacks_dir = tempfile.TemporaryDirectory(prefix="vescale-rank-stacks-")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.world_size, port, child, list(sys.path),
                                                     self._stacks_file(rank)), daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(120 * _SLOWDOWN):
                self.close()
                raise RuntimeError(f"rank {rank} of the test pool did not start")
            conn.recv()

    def run(self, fn, *args, timeout: float = 300, **kwargs) -> list:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the per-rank results."""
        msg = (fn.__module__, fn.__name__, args, kwargs)
        results, errors, hung = [None] * self.world_size, {}, []
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (BrokenPipeError, EOFError, OSError):
                errors[rank] = f"rank {rank} had died before this case (exit code {self._procs[rank].exitcode})"
        for rank, conn in enumerate(self._conns):
            if rank in errors:
                continue
            wait = (timeout if not errors else _RESTART_GRACE_S) * _SLOWDOWN
            try:
                if not conn.poll(wait):
                    hung.append(rank)
                    continue
                status, value = conn.recv()
            except (EOFError, OSError):  # the process died (a crash in C++: its stderr has the frame)
                self._procs[rank].join(5)
                errors[rank] = f"rank {rank} died (exit code {self._procs[rank].exitcode}); see its stderr above"
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors or hung:
            stacks = self._where_hung(hung)
            # A rank that raised may have left a collective half done (gloo then times
            # out and closes its pairs), which would fail every later test on this
            # pool: start afresh.
            self.close()
            self._start()
            report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if hung:
                report += f"\nranks {hung} did not answer (the pool was restarted); where they were:{stacks}"
            raise AssertionError(f"{fn.__name__} failed:{report}")
        return results

    def _stacks_file(self, rank: int) -> str:
        return os.path.join(self._stacks_dir.name, f"rank{rank}.txt")

    def _where_hung(self, hung: list[int]) -> str:
        """The Python stacks of the ranks that did not answer, as they dumped them on SIGUSR1."""
        if not hung:
            return ""
        for rank in hung:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(2)  # faulthandler writes from its C signal handler: also from inside a C++ wait
        report = ""
        for rank in hung:
            with open(self._stacks_file(rank)) as f:
                report += f"\n--- rank {rank} (stacks at SIGUSR1) ---\n{f.read() or '(nothing written)'}"
        return report

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._procs, self._conns = [], []
