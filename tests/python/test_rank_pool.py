"""The test pool itself: a rank that stops answering is reported with where it was."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist


def _rank_one_waits_in_a_function_named_here():
    if dist.get_rank() == 1:
        time.sleep(30)
    return dist.get_rank()


def test_a_hung_rank_is_reported_with_its_stack(pool2):
    with pytest.raises(AssertionError) as raised:
        pool2.run(_rank_one_waits_in_a_function_named_here, timeout=3)
    report = str(raised.value)
    assert "ranks [1] did not answer" in report
    assert "rank 1 (stacks at SIGUSR1)" in report
    assert "_rank_one_waits_in_a_function_named_here" in report
    assert pool2.run(dist.get_rank) == [0, 1]  # the restarted pool works
