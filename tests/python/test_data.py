"""vescale.DataLoader: on DP2xTP2 and DP4 the DP ranks' local batches of every step,
put together in DP order, are the global batch that a single-process loader yields
(in order), TP peers read identical batches, and runs are deterministic. A loader saved
mid-epoch (state_dict, or vescale.save) resumes on the same or another DP degree, and
with another global batch size, with exactly the samples of the epoch not yet seen,
each once. drop_last=False splits the last batch like torch.tensor_split (down to empty
batches). Error paths: datasets that are not map-style, batch sizes that do not divide,
states that do not fit.

Samples are TensorDataset rows (id, id / 2), so a batch says which samples it holds."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, TensorDataset

import vescale
from vescale.data import DataLoader

from dist_utils import mesh

N = 48


def _dataset(n: int = N) -> TensorDataset:
    ids = torch.arange(n)
    return TensorDataset(ids, ids.double() / 2)


def _ids(batch) -> list[int]:
    ids, halves = batch
    assert isinstance(ids, torch.Tensor) and not isinstance(ids, vescale.DTensor)
    assert torch.equal(halves, ids.double() / 2), "the two fields of a sample came apart"
    return ids.tolist()


def _epochs(loader: DataLoader, epochs: int) -> list[list[list[int]]]:
    """The ids of every batch of ``epochs`` epochs: [epoch][step] -> ids."""
    out = []
    for _ in range(epochs):
        out.append([_ids(b) for b in loader])
    return out


def _reference(n: int = N, **kwargs) -> list[list[list[int]]]:
    """Global batches of a single-process loader (DP degree 1), 2 epochs."""
    return _epochs(DataLoader(_dataset(n), None, **kwargs), 2)


def _dp_coord(m: vescale.DeviceMesh, dp_dim: str) -> tuple[int, tuple]:
    """(this rank's DP index, its other coordinates)."""
    coord = m.get_coordinate()
    d = m.mesh_dim_names.index(dp_dim)
    return coord[d], tuple(c for i, c in enumerate(coord) if i != d)


def _assemble(answers, dp: int) -> list[list[list[int]]]:
    """The global batches from the ranks' answers (dp index, others, batches): each step's
    local batches in DP order, taken from the ranks whose other coordinates are 0; also
    checks that every rank's batches equal those of the rank with its DP index and other
    coordinates 0 (TP peers read the same)."""
    by_dp = {}
    for dp_index, others, batches in answers:
        if all(c == 0 for c in others):
            by_dp[dp_index] = batches
    assert sorted(by_dp) == list(range(dp))
    for dp_index, others, batches in answers:
        assert batches == by_dp[dp_index], f"DP rank {dp_index} at {others} reads other batches than its peers"
    epochs = len(by_dp[0])
    return [[sum((by_dp[r][e][t] for r in range(dp)), []) for t in range(len(by_dp[0][e]))]
            for e in range(epochs)]


# ---- a single process (DP degree 1) ----------------------------------------------------------

def test_an_epoch_is_the_seeded_permutation_cut_into_global_batches():
    loader = DataLoader(_dataset(), None, global_batch_size=8, seed=3)
    assert len(loader) == 6 and loader.epoch == 0
    first = [_ids(b) for b in loader]
    assert loader.epoch == 1 and loader.consumed == 0
    g = torch.Generator().manual_seed(vescale.data.epoch_seed(3, 0))
    perm = torch.randperm(N, generator=g).tolist()
    assert first == [perm[t * 8:(t + 1) * 8] for t in range(6)]
    second = [_ids(b) for b in loader]
    assert loader.epoch == 2
    assert sorted(sum(second, [])) == list(range(N)) and second != first  # a new order every epoch
    # determinism: the same seed gives the same batches, another seed others
    assert _reference(global_batch_size=8, seed=3) == [first, second]
    assert _reference(global_batch_size=8, seed=4)[0] != first
    # the epoch seed is not seed + epoch: seed 4's first epoch is not seed 3's second
    assert _reference(global_batch_size=8, seed=4)[0] != second
    assert _reference(global_batch_size=8, shuffle=False)[1] == [list(range(t * 8, t * 8 + 8)) for t in range(6)]


def test_drop_last_and_set_epoch():
    kept = DataLoader(_dataset(50), None, global_batch_size=8, drop_last=False, shuffle=False)
    assert len(kept) == 7 and [len(_ids(b)) for b in kept] == [8] * 6 + [2]
    dropped = DataLoader(_dataset(50), None, global_batch_size=8, seed=1)
    assert len(dropped) == 6
    batches = [_ids(b) for b in dropped]
    assert len(batches) == 6 and len(set(sum(batches, []))) == 48
    dropped.set_epoch(5)
    assert dropped.epoch == 5 and dropped.consumed == 0
    fifth = [_ids(b) for b in dropped]
    assert dropped.epoch == 6 and fifth == [x[:8] for x in dropped.global_batch_indices(5)]
    # set_epoch of the current epoch keeps the position (a resumed loop calling set_epoch)
    it = iter(dropped)
    next(it), next(it)
    dropped.set_epoch(6)
    assert dropped.consumed == 16
    dropped.set_epoch(7)
    assert (dropped.epoch, dropped.consumed) == (7, 0)


def test_a_loop_left_early_resumes_and_one_left_after_the_last_batch_moves_on():
    loader = DataLoader(_dataset(), None, global_batch_size=8, seed=2)
    ref = _reference(global_batch_size=8, seed=2)
    seen = []
    for batch in loader:
        seen.append(_ids(batch))
        if len(seen) == 2:
            break
    assert loader.state_dict() == {"epoch": 0, "consumed": 16, "seed": 2, "shuffle": True, "global_batch_size": 8}
    seen += [_ids(b) for b in loader]
    assert seen == ref[0] and loader.epoch == 1
    seen = []
    for batch in loader:  # break after the epoch's last batch: the next loop reads the next epoch
        seen.append(_ids(batch))
        if len(seen) == 6:
            break
    assert (loader.epoch, loader.consumed) == (1, N)
    assert [_ids(b) for b in loader] == _epochs(DataLoader(_dataset(), None, global_batch_size=8, seed=2), 3)[2]


# ---- on 4 ranks --------------------------------------------------------------------------------

def _case_batches(mesh_name: str, dp_dim: str, n: int, kwargs: dict):
    m = mesh(mesh_name)
    dp_index, others = _dp_coord(m, dp_dim)
    loader = DataLoader(_dataset(n), m, dp_dim=dp_dim, **kwargs)
    again = DataLoader(_dataset(n), m, dp_dim=dp_dim, **kwargs)
    batches = _epochs(loader, 2)
    assert _epochs(again, 2) == batches, "two loaders with the same seed read different batches"
    return dp_index, others, batches, (loader.dp_size, loader.dp_rank, loader.local_batch_size, len(loader))


MESH_CASES = [("2d", "DP", 2), ("1d4", "TP", 4)]


@pytest.mark.parametrize("mesh_name,dp_dim,dp", MESH_CASES, ids=["dp2xtp2", "dp4"])
def test_dp_ranks_together_read_the_single_process_global_batches(pool4, mesh_name, dp_dim, dp):
    kwargs = dict(global_batch_size=8, seed=7)
    answers = pool4.run(_case_batches, mesh_name, dp_dim, N, kwargs)
    for dp_index, _, batches, (size, rank, local, steps) in answers:
        assert (size, rank, local, steps) == (dp, dp_index, 8 // dp, 6)
        assert all(len(b) == 8 // dp for epoch in batches for b in epoch)
    assert _assemble([a[:3] for a in answers], dp) == _reference(**kwargs)


@pytest.mark.parametrize("n,sizes", [(46, [2, 2, 1, 1]), (49, [1, 0, 0, 0])], ids=["tail6", "tail1"])
def test_drop_last_false_splits_the_last_batch_like_tensor_split(pool4, n, sizes):
    kwargs = dict(global_batch_size=8, seed=1, drop_last=False)
    answers = pool4.run(_case_batches, "1d4", "TP", n, kwargs)
    assert _assemble([a[:3] for a in answers], 4) == _reference(n, **kwargs)
    for dp_index, _, batches, _ in answers:
        assert [len(epoch[-1]) for epoch in batches] == [sizes[dp_index]] * 2
        assert all(len(b) == 2 for epoch in batches for b in epoch[:-1])


def _case_empty_batch() -> tuple[tuple, tuple, str]:
    loader = DataLoader(_dataset(49), mesh("1d4"), dp_dim="TP", global_batch_size=8, shuffle=False, drop_last=False)
    *_, last = list(loader)
    ids, halves = last
    return tuple(ids.shape), tuple(halves.shape), str(halves.dtype)


def test_a_rank_without_samples_gets_an_empty_batch(pool4):
    answers = pool4.run(_case_empty_batch)
    assert answers == [((1,), (1,), "torch.float64")] + [((0,), (0,), "torch.float64")] * 3


def _case_resume(src: tuple, dst: tuple, k: int) -> tuple[list, list, dict, int]:
    """Reads k steps of epoch 1 on ``src`` (mesh, dp_dim, global batch), then the rest of
    the epoch on ``dst`` from the state: (ids this rank read before, after, the state,
    the epoch after)."""
    src_mesh, src_dp, src_g = src
    dst_mesh, dst_dp, dst_g = dst
    loader = DataLoader(_dataset(), mesh(src_mesh), dp_dim=src_dp, global_batch_size=src_g, seed=5)
    _epochs(loader, 1)
    before = []
    for batch in loader:
        before.append(_ids(batch))
        if len(before) == k:
            break
    state = loader.state_dict()
    resumed = DataLoader(_dataset(), mesh(dst_mesh) if dst_mesh else None, dp_dim=dst_dp, global_batch_size=dst_g,
                         seed=99, shuffle=False)  # seed and shuffle come from the state
    resumed.load_state_dict(state)
    after = [_ids(b) for b in resumed]
    return before, after, state, resumed.epoch


def _epoch_one() -> list[int]:
    return sum(_reference(global_batch_size=8, seed=5)[1], [])


RESUMES = {
    "dp2-to-dp2": (("2d", "DP", 8), ("2d", "DP", 8), 2, 2),
    "dp2-to-dp4": (("2d", "DP", 8), ("1d4", "TP", 8), 2, 4),
    "dp2-to-dp1": (("2d", "DP", 8), ("2d", None, 8), 2, 1),
    "dp2-to-single-process": (("2d", "DP", 8), (None, "DP", 8), 2, 1),
    "dp4-to-dp2-batch-4": (("1d4", "TP", 8), ("2d", "DP", 4), 3, 2),
    "dp2-to-dp4-batch-16": (("2d", "DP", 8), ("1d4", "TP", 16), 4, 4),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_reads_each_remaining_sample_of_the_epoch_once(pool4, case):
    src, dst, k, dst_dp = RESUMES[case]
    answers = pool4.run(_case_resume, src, dst, k)
    perm = _epoch_one()
    src_dp = {"2d": 2, "1d4": 4}[src[0]]
    consumed = k * src[2]
    for _, _, state, epoch in answers:
        assert state == {"epoch": 1, "consumed": consumed, "seed": 5, "shuffle": True, "global_batch_size": src[2]}
        assert epoch == 2
    # the ranks' own slices: rank r of a 2x2 mesh has DP index r // 2, of 1-d meshes r
    def dp_index(mesh_name, dp_dim, rank):
        return 0 if mesh_name is None or dp_dim is None else (rank // 2 if mesh_name == "2d" else rank)
    before = _gather(answers, 0, src_dp, lambda r: dp_index(src[0], src[1], r))
    after = _gather(answers, 1, dst_dp, lambda r: dp_index(dst[0], dst[1], r))
    g = dst[2]
    assert before == [perm[t * src[2]:(t + 1) * src[2]] for t in range(k)]
    assert after == [perm[consumed + t * g:consumed + (t + 1) * g] for t in range((N - consumed) // g)]
    seen = sum(before, []) + sum(after, [])
    assert sorted(seen) == list(range(N)), "a sample was read twice or skipped"


def _gather(answers, which: int, dp: int, dp_index) -> list[list[int]]:
    """Global batches from the ranks' ``which``-th answer, checking that ranks with one DP
    index read the same."""
    by_dp = {}
    for rank, answer in enumerate(answers):
        by_dp.setdefault(dp_index(rank), []).append(answer[which])
    assert sorted(by_dp) == list(range(dp))
    for r, copies in by_dp.items():
        assert all(c == copies[0] for c in copies), f"ranks with DP index {r} read different batches"
    steps = len(by_dp[0][0])
    return [sum((by_dp[r][0][t] for r in range(dp)), []) for t in range(steps)]


def _case_checkpoint(path: str) -> tuple[list, dict, dict]:
    """vescale.save of a DP2 loader after 3 steps of epoch 0, vescale.load into a DP4 one."""
    loader = DataLoader(_dataset(), mesh("2d"), global_batch_size=8, seed=5)
    it = iter(loader)
    for _ in range(3):
        next(it)
    vescale.save(path, {"data": loader})
    resumed = DataLoader(_dataset(), mesh("1d4"), dp_dim="TP", global_batch_size=8, seed=0)
    vescale.load(path, {"data": resumed})
    return [_ids(b) for b in resumed], resumed.state_dict(), loader.state_dict()


def test_vescale_save_and_load_resume_the_loader(pool4, tmp_path):
    path = str(tmp_path / "ckpt")
    answers = pool4.run(_case_checkpoint, path)
    perm = sum(_reference(global_batch_size=8, seed=5)[0], [])
    for rank, (after, state, saved) in enumerate(answers):
        assert saved == {"epoch": 0, "consumed": 24, "seed": 5, "shuffle": True, "global_batch_size": 8}
        assert state == {"epoch": 1, "consumed": 0, "seed": 5, "shuffle": True, "global_batch_size": 8}
        assert after == [perm[24 + t * 8 + rank * 2:24 + t * 8 + rank * 2 + 2] for t in range(3)]
    with open(os.path.join(path, "objects.json")) as f:
        assert json.load(f)["values"]["data"] == saved  # stored as plain JSON values


def _case_bad_checkpoint(path: str) -> tuple[str, str, dict]:
    """A state from a 48-sample dataset at sample 40 does not fit a 32-sample dataset:
    vescale.load raises on every rank and changes nothing (the tensor too stays)."""
    loader = DataLoader(_dataset(), mesh("2d"), global_batch_size=8)
    it = iter(loader)
    for _ in range(5):
        next(it)
    vescale.save(path, {"data": loader, "t": torch.ones(3)})
    small = DataLoader(_dataset(32), mesh("2d"), global_batch_size=8, seed=1)
    t = torch.zeros(3)
    try:
        vescale.load(path, {"data": small, "t": t})
    except ValueError as e:
        return "raised", str(e), {**small.state_dict(), "t": t.tolist()}
    return "loaded", "", small.state_dict()


def test_a_loader_state_that_does_not_fit_fails_the_whole_load(pool4, tmp_path):
    answers = pool4.run(_case_bad_checkpoint, str(tmp_path / "ckpt"))
    for outcome, message, state in answers:
        assert outcome == "raised"
        assert state == {"epoch": 0, "consumed": 0, "seed": 1, "shuffle": True, "global_batch_size": 8,
                         "t": [0.0, 0.0, 0.0]}, "a failed load changed the state"
        assert "'data'" in message and "40" in message and "32" in message, message


# ---- errors -----------------------------------------------------------------------------------

def _case_errors() -> list[str]:
    out = []
    for make in (lambda: DataLoader(_dataset(), mesh("2d"), global_batch_size=7),
                 lambda: DataLoader(_dataset(), mesh("1d4"), dp_dim="TP", global_batch_size=6),
                 lambda: DataLoader(_dataset(), mesh("2d"), dp_dim="dp", global_batch_size=8)):
        try:
            make()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    m = mesh("1d2")  # ranks 2 and 3 are not part of it
    try:
        DataLoader(_dataset(), m, dp_dim="TP", global_batch_size=8)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    dist.barrier()
    return out


def test_batch_sizes_that_do_not_divide_and_ranks_outside_the_mesh(pool4):
    for rank, (seven, six, lower, outside) in enumerate(pool4.run(_case_errors)):
        assert "global_batch_size 7" in seven and "DP degree 2" in seven and "multiple of 2" in seven, seven
        assert "global_batch_size 6" in six and "DP degree 4" in six and "multiple of 4" in six, six
        assert "no dim 'dp'" in lower and "dp_dim='DP'" in lower, lower
        if rank < 2:
            assert outside == "no error"
        else:
            assert f"rank {rank} is not part of the mesh" in outside, outside


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class _NoLen:
    def __getitem__(self, i):
        return i


def test_error_messages_name_the_value_and_the_fix():
    with pytest.raises(TypeError, match="map-style dataset.*IterableDataset _Stream.*TensorDataset"):
        DataLoader(_Stream(), None, global_batch_size=2)
    with pytest.raises(TypeError, match="map-style.*_NoLen has no __len__.*TensorDataset"):
        DataLoader(_NoLen(), None, global_batch_size=2)
    for bad in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match=f"global_batch_size must be a positive int.*{bad!r}"):
            DataLoader(_dataset(), None, global_batch_size=bad)
    with pytest.raises(ValueError, match="48 samples make no global batch of 64 with drop_last=True.*drop_last=False"):
        DataLoader(_dataset(), None, global_batch_size=64)
    assert len(DataLoader(_dataset(), None, global_batch_size=64, drop_last=False)) == 1
    with pytest.raises(TypeError, match="collate_fn must be a callable"):
        DataLoader(_dataset(), None, global_batch_size=8, collate_fn="stack")
    with pytest.raises(TypeError, match="seed must be an int.*'0'"):
        DataLoader(_dataset(), None, global_batch_size=8, seed="0")
    loader = DataLoader(_dataset(), None, global_batch_size=8)
    with pytest.raises(ValueError, match="set_epoch needs an epoch number >= 0, got -1"):
        loader.set_epoch(-1)
    good = loader.state_dict()
    for bad, match in [({**good, "consumed": 49}, "49 samples of epoch 0 were consumed, but this dataset has 48"),
                       ({**good, "consumed": 8.0}, "'consumed' must be an int, got 8.0"),
                       ({**good, "shuffle": 1}, "'shuffle' must be True or False, got 1"),
                       ({k: v for k, v in good.items() if k != "seed"}, r"missing \['seed'\]"),
                       ({**good, "rank": 0}, r"unknown \['rank'\]"),
                       ([1, 2], "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            loader.load_state_dict(bad)
    assert loader.state_dict() == good


def test_a_custom_collate_fn_gets_the_samples_of_this_rank():
    seen = []

    def collate(samples):
        seen.append(len(samples))
        return torch.stack([s[0] for s in samples]) * 10

    loader = DataLoader(_dataset(), None, global_batch_size=12, shuffle=False, collate_fn=collate)
    assert [b.tolist() for b in loader][1] == [i * 10 for i in range(12, 24)] and seen == [12] * 4
