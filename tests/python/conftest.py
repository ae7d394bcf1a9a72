import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from rank_pool import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size)
    return _pools[world_size]


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    return _pool(2)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    return _pool(4)


@pytest.fixture(scope="module", autouse=True)
def fresh_pools_per_module():
    """Each test module gets ranks of its own (started on first use, closed after the
    module): a module's cases share their ranks' history, not the whole session's. Ranks
    that had run every earlier module crashed intermittently in test_ops (the open
    heap-corruption problem in docs/engine.md); per-module ranks bound that history."""
    yield
    for size in list(_pools):
        _pools.pop(size).close()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
