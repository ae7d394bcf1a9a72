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


# Each test module gets ranks of its own (started on first use, closed after the module):
# a module's cases share their ranks' history, not the whole session's, so what one
# module leaves behind (a restarted pool, state in torch's or vescale's caches) cannot
# decide another's result.
@pytest.fixture(scope="module")
def pool2():
    yield _pool(2)
    _pools.pop(2).close()


@pytest.fixture(scope="module")
def pool4():
    yield _pool(4)
    _pools.pop(4).close()


@pytest.fixture(scope="module")
def pool8():  # 3-d meshes with two ranks per dim (sub-meshes that do not span the world)
    yield _pool(8)
    _pools.pop(8).close()


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
