"""Every rank must agree on a DTensor's global strides: they steer later ops (whether
``contiguous()`` copies, whether a ``view`` is legal, whether a result aliases its input).
The ranks used to read them off tensors of their own, which can differ:

- ``DTensor.from_local`` with uneven shards: a dim with one element on some ranks and
  more on others may have any stride there, so those ranks placed it elsewhere in memory
  order (or missed that it was expanded). Now the mesh's first rank's reading is taken.
- ``distribute_tensor`` with ``src_data_rank`` (the default): the values come from that
  rank, but each rank took the strides of its own tensor (rank 0's loaded, transposed
  weight beside the others' ``torch.empty`` placeholders). Now the source's strides are.

- ``DTensor.from_local`` over a view-copy's shard (the to_local of a view that had to be
  taken from a copy): whether the DTensor wraps the shard or copies it is each rank's own
  answer (uneven shards answer differently), and only the wrapping ranks took the copy's
  record in a collective of their own, which paired with the others' next collective
  (``x.sum()`` returned half the sum, then gloo aborted). Now the ranks agree on both.

- ``DTensor.from_local`` with uneven shards whose layout differs from the claimed global
  one: the ranks with more rows copied their shard, those with one row wrapped it, so a
  later write into the caller's tensor reached the DTensor on some ranks only.

Each case failed silently before: ``y = x.contiguous(); y.mul_(0)`` zeroed ``x`` on some
ranks, because there ``contiguous()`` returned ``x`` itself. On 4 ranks, a 2x2 mesh.
"""

from __future__ import annotations

import torch

from dist_utils import mesh


def _contiguous_copy_leaves_original(x, expected: torch.Tensor) -> tuple:
    y = x.contiguous()
    y.mul_(0)
    return tuple(x.stride()), torch.equal(x.full_tensor(), expected)


def _from_local_uneven_transposed() -> tuple:
    from vescale import DTensor, Shard, Replicate

    m = mesh("2d")
    B, S, D = 3, 2, 2  # 3 rows over 2 ranks: 2 and 1
    row = m.get_coordinate()[0]
    n = 2 if row == 0 else 1
    h = torch.randn(S, B, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # a sequence-first buffer of this rank's rows, handed over batch-first (a transposed view)
    local = h[:, 2 * row:2 * row + n].contiguous().transpose(0, 1)
    x = DTensor.from_local(local, m, [Shard(0), Replicate()], shape=(B, S, D))
    return _contiguous_copy_leaves_original(x, h.transpose(0, 1))


def _from_local_uneven_expanded() -> tuple:
    from vescale import DTensor, Shard, Replicate

    m = mesh("2d")
    row = m.get_coordinate()[0]
    bias = torch.arange(4, dtype=torch.float64)
    local = bias.expand(2 if row == 0 else 1, 4)  # 3 rows over 2 ranks, each a broadcast of one row
    x = DTensor.from_local(local, m, [Shard(0), Replicate()], shape=(3, 4))
    return tuple(x.stride()), torch.equal(x.full_tensor(), bias.expand(3, 4))


def _distribute_from_rank0_layout() -> tuple:
    import torch.distributed as dist

    import vescale
    from vescale import Shard, Replicate

    m = mesh("2d")
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).t()
    full = w if dist.get_rank() == 0 else torch.empty(4, 6, dtype=torch.float64)  # only rank 0 loaded it
    x = vescale.distribute_tensor(full, m, [Shard(0), Replicate()])
    return _contiguous_copy_leaves_original(x, w)


def _from_local_over_a_view_copy() -> tuple:
    import vescale
    from vescale import DTensor, Shard, Replicate

    m = mesh("2d")
    full = torch.arange(3 * 4 * 6, dtype=torch.float64).reshape(3, 4, 6)
    x = vescale.distribute_tensor(full, m, [Shard(0), Replicate()])  # 3 rows over 2 ranks: 2 and 1
    y = x.view(12, 6)  # cannot stay sharded: a view of a copy, kept in step with x
    shard = y.to_local()
    row = m.get_coordinate()[0]
    mine = shard[:2] if row == 0 else shard[2:3]  # y's first 3 rows, split unevenly, as views
    # the claimed global layout is column-major: the ranks with 2 rows must copy their
    # row-major views, the ranks with 1 row could wrap theirs, and must not alone
    z = DTensor.from_local(mine, m, [Shard(0), Replicate()], shape=(3, 6), stride=(1, 3))
    total = x.sum().full_tensor().item()  # the collective after from_local
    right = total == full.sum().item() and torch.equal(z.full_tensor(), full.view(12, 6)[:3])
    z.mul_(0)  # a copy on every rank: x is left alone
    return tuple(z.stride()), right and torch.equal(x.full_tensor(), full)


def _from_local_uneven_claimed_layout() -> tuple:
    from vescale import DTensor, Shard, Replicate

    m = mesh("2d")
    row = m.get_coordinate()[0]
    full = torch.arange(3 * 6, dtype=torch.float64).reshape(3, 6)
    mine = full[:2].clone() if row == 0 else full[2:].clone()  # row-major, 3 rows over 2 ranks
    # claimed column-major: the 2-row ranks copy; the 1-row ranks could wrap, and must not alone
    z = DTensor.from_local(mine, m, [Shard(0), Replicate()], shape=(3, 6), stride=(1, 3))
    mine.add_(100)  # the caller reuses its buffer: z follows it on every rank, or on none
    return tuple(z.stride()), torch.equal(z.full_tensor(), full)


def _agree(results: list) -> None:
    strides = {r[0] for r in results}
    assert len(strides) == 1, f"ranks disagree on the global strides: {[r[0] for r in results]}"
    assert all(r[1] for r in results), f"wrong values on some ranks: {results}"


def test_from_local_uneven_transposed_shards_agree(pool4):
    results = pool4.run(_from_local_uneven_transposed)
    _agree(results)
    assert results[0][0] == (2, 6, 1)  # the first rank's order (dim 1 outermost), densely packed


def test_from_local_uneven_expanded_shards_agree(pool4):
    results = pool4.run(_from_local_uneven_expanded)
    _agree(results)
    assert results[0][0] == (0, 1)  # stays a broadcast


def test_distribute_tensor_takes_the_source_layout(pool4):
    results = pool4.run(_distribute_from_rank0_layout)
    _agree(results)
    assert results[0][0] == (1, 4)  # rank 0's transposed weight


def test_from_local_over_a_view_copy_copies_everywhere_or_nowhere(pool4):
    results = pool4.run(_from_local_over_a_view_copy)
    _agree(results)
    assert results[0][0] == (1, 3)



def test_from_local_uneven_wraps_everywhere_or_nowhere(pool4):
    results = pool4.run(_from_local_uneven_claimed_layout)
    _agree(results)
    assert results[0][0] == (1, 3)
