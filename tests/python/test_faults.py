"""A rank that dies or stops taking part makes the other ranks fail with a clear error
within the collective timeout instead of hanging; debug mode turns ranks that issue
different collectives into an immediate error.

Each case launches its own 4-rank job (fault_worker.py, with torchrun's environment
variables, so vescale.init_device_mesh initialises torch.distributed itself): a dead
rank would break the shared rank pool. The jobs use a collective timeout of 10 s; the
only timing asserted is a generous bound that tells an error from a hang.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_worker.py")
WORLD, VICTIM = 4, 2
TIMEOUT_S = 10  # VESCALE_COLLECTIVE_TIMEOUT of the jobs
HANG_S = 90     # a job still running this long after the failure hangs
START_S = 120   # start-up and the steps before the failure, on a busy machine

# What the survivors report: gloo's own message, and the note vescale adds.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
TIMED_OUT = "Timed out waiting"
NOTE_LOST = "vescale: a collective lost its connection to another rank, which probably failed"
NOTE_TIMEOUT = "vescale: a collective timed out (vescale's collective timeout: 10 s): another rank probably failed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, point: str, how: str = "kill", **env) -> tuple[list[int | None], list[str], float | None]:
    """Runs the job; returns each rank's exit code (None: still running, then killed),
    its stderr, and how long after the victim failed the last rank exited."""
    port = _free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VESCALE_COLLECTIVE_TIMEOUT=str(TIMEOUT_S),
                        OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
        procs.append(subprocess.Popen([sys.executable, WORKER, point, how, str(VICTIM), str(tmp_path / "ckpt")],
                                      env=rank_env, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT))
        logs.append(log)
    deadline, failed_at = time.time() + START_S + HANG_S, None
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if failed_at is None:
            failed_at = _failure_time(tmp_path)
            deadline = failed_at + HANG_S if failed_at else deadline
        time.sleep(0.2)
    last_exit = time.time()
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    texts = [(tmp_path / f"rank{r}.log").read_text() for r in range(WORLD)]
    for log in logs:
        log.close()
    failed_at = failed_at or _failure_time(tmp_path)
    return codes, texts, None if failed_at is None else last_exit - failed_at


def _failure_time(tmp_path) -> float | None:
    text = (tmp_path / f"rank{VICTIM}.log").read_text()
    m = re.search(r"rank \d+ (?:fails in \w+|redistributes) at ([\d.]+)", text)
    return float(m.group(1)) if m else None


def _explain(codes, texts) -> str:
    return "\n".join(f"--- rank {r} exit {c} ---\n{t[-2500:]}" for r, (c, t) in enumerate(zip(codes, texts)))


@pytest.mark.parametrize("point", ["forward", "backward", "step", "save", "load"])
def test_killed_rank_makes_the_others_fail(tmp_path, point):
    codes, texts, elapsed = _launch(tmp_path, point, "kill")
    assert elapsed is not None, f"the victim never reached {point}:\n{_explain(codes, texts)}"
    assert codes[VICTIM] == -signal.SIGKILL, _explain(codes, texts)
    for rank in set(range(WORLD)) - {VICTIM}:
        assert codes[rank] not in (None, 0), f"rank {rank} did not fail:\n{_explain(codes, texts)}"
        text = texts[rank]
        assert any(s in text for s in PEER_LOST) or TIMED_OUT in text, _explain(codes, texts)
        assert NOTE_LOST in text or NOTE_TIMEOUT in text, _explain(codes, texts)
    print(f"kill in {point}: every rank exited {elapsed:.1f} s after the victim died")


def test_rank_that_raises_and_moves_on_makes_the_others_time_out(tmp_path):
    """The victim survives its exception and waits in a barrier on the world group while
    the others wait in the training step's collectives: nobody's peer disappears, so only
    the timeout ends it."""
    codes, texts, elapsed = _launch(tmp_path, "forward", "raise")
    assert elapsed is not None, _explain(codes, texts)
    assert all(c not in (None, 0) for c in codes), _explain(codes, texts)
    assert "raised and goes on to a barrier" in texts[VICTIM]
    timed_out = [r for r in range(WORLD) if TIMED_OUT in texts[r] and NOTE_TIMEOUT in texts[r]]
    assert set(timed_out) - {VICTIM}, f"nobody reported the timeout:\n{_explain(codes, texts)}"
    print(f"raise in forward: every rank exited {elapsed:.1f} s after the victim raised")


def test_finalist_failing_on_one_rank_ends_planning_with_its_error(tmp_path):
    """The planner trains its finalists; the victim's first optimizer step raises while the
    others wait in the step's collectives. The victim cannot rejoin them: it raises an
    error naming the finalist and its own error (it used to go on to the next collective
    and pair it with theirs), and the others time out."""
    codes, texts, elapsed = _launch(tmp_path, "finalist")
    assert elapsed is not None, f"the victim never trained a finalist:\n{_explain(codes, texts)}"
    assert all(c not in (None, 0) for c in codes), _explain(codes, texts)
    assert re.search(r"training the finalist .+ failed on rank 2 \(RuntimeError: injected failure in a finalist\)",
                     texts[VICTIM]), _explain(codes, texts)
    for rank in set(range(WORLD)) - {VICTIM}:
        assert TIMED_OUT in texts[rank] or any(s in texts[rank] for s in PEER_LOST), _explain(codes, texts)
    print(f"a finalist failing on one rank: every rank exited {elapsed:.1f} s after the victim raised")


def test_debug_mode_reports_ranks_that_issue_different_collectives(tmp_path):
    """Rank 2's all-reduce has more rows than rank 3's (its TP partner): in debug mode
    both fail at once, naming the two collectives, instead of exchanging data of the
    wrong size. The other TP group is consistent and finishes."""
    codes, texts, elapsed = _launch(tmp_path, "diverge", VESCALE_DEBUG="1")
    assert elapsed is not None, _explain(codes, texts)
    for rank in (2, 3):
        assert codes[rank] not in (None, 0), _explain(codes, texts)
        assert "Detected mismatch between collectives on ranks" in texts[rank], _explain(codes, texts)
        assert "TensorShape=[6, 4]" in texts[rank] and "TensorShape=[4, 4]" in texts[rank]
    assert codes[0] == codes[1] == 0, _explain(codes, texts)


# ---- the timeouts themselves, in the shared pool -----------------------------------------------

def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _case_group_timeouts() -> list[float]:
    import vescale
    from dist_utils import mesh
    from vescale.checkpoint.agreement import _checkpoint_group

    m = mesh("2d")  # the pool sets VESCALE_COLLECTIVE_TIMEOUT=120, as its world group's
    own = vescale.DeviceMesh("cpu", [[0, 1], [2, 3]], timeout=7)
    return [_timeout_s(g) for g in (m.get_group(0), m.get_group(1), _checkpoint_group(), own.get_group(0),
                                    own.get_group(1))]


def test_every_group_has_the_vescale_timeout(pool4):
    """torch's new_group would give sub-groups 30 minutes, whatever the world group has."""
    assert pool4.run(_case_group_timeouts) == [[120.0, 120.0, 120.0, 7.0, 7.0]] * WORLD
