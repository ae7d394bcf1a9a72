"""Every redistribution transition on 1-d (2 and 4 ranks) and 2-d (2x2) meshes,
even and uneven shapes, checked against the global tensor; gradients through
redistribute / from_local / to_local / full_tensor; distribute_tensor."""

import pytest
import torch

import vescale
from vescale import Partial, Replicate, Shard

from dist_utils import describe, make_dtensor, mesh, mismatch, placement_options, rand


def _case_transitions(mesh_name: str, shape, partial_ops):
    m = mesh(mesh_name)
    full = rand(shape, seed=1)
    failures = []
    options = placement_options(len(shape), m.ndim, partial=partial_ops)
    for src in options:
        x = make_dtensor(full, m, src, seed=2)
        for dst in options:
            y = x.redistribute(m, dst)
            if list(y.placements) != [p if not p.is_shard() else Shard(p.dim % len(shape)) for p in dst]:
                failures.append(f"{describe(src)} -> {describe(dst)}: placements {y.placements}")
                continue
            expect_local, _ = vescale._C.local_shape(list(shape), vescale.placement_types.to_c(
                [Replicate() if p.is_partial() else p for p in dst]), list(m.shape), list(m.get_coordinate()))
            if list(y.to_local().shape) != expect_local:
                failures.append(f"{describe(src)} -> {describe(dst)}: local shape {tuple(y.to_local().shape)}")
            err = mismatch(y.full_tensor(), full)
            if err:
                failures.append(f"{describe(src)} -> {describe(dst)}: {err}")
    return failures


@pytest.mark.parametrize("shape", [(4, 6), (5, 3)], ids=["even", "uneven"])
def test_transitions_1d_2ranks(pool2, shape):
    for failures in pool2.run(_case_transitions, "1d2", shape, ("sum", "avg", "max", "min")):
        assert failures == []


@pytest.mark.parametrize("shape", [(4, 8), (5, 6), (3, 2)], ids=["even", "uneven", "empty-shards"])
def test_transitions_1d_4ranks(pool4, shape):
    for failures in pool4.run(_case_transitions, "1d4", shape, ("sum", "avg", "max", "min")):
        assert failures == []


@pytest.mark.parametrize("shape", [(4, 8), (5, 3)], ids=["even", "uneven"])
def test_transitions_2d(pool4, shape):
    for failures in pool4.run(_case_transitions, "2d", shape, ("sum", "max")):
        assert failures == []


def _case_redistribute_is_differentiable(mesh_name: str, async_op: bool = False):
    m = mesh(mesh_name)
    full = rand((6, 4), seed=3)
    weight = rand((6, 4), seed=4)
    failures = []
    for src in placement_options(2, m.ndim, partial=()):
        for dst in placement_options(2, m.ndim):
            x = make_dtensor(full, m, src, requires_grad=True)
            y = x.redistribute(m, dst, async_op=async_op)
            w = make_dtensor(weight, m, [Replicate()] * m.ndim)
            (y * w).sum().backward()
            err = mismatch(x.grad.full_tensor(), weight)
            if err:
                failures.append(f"{describe(src)} -> {describe(dst)}: grad {err}")
            if list(x.grad.placements) != list(src):
                failures.append(f"{describe(src)} -> {describe(dst)}: grad placements {x.grad.placements}")
    return failures


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("mesh_name", ["1d4", "2d"])
def test_redistribute_backward(pool4, mesh_name, async_op):
    for failures in pool4.run(_case_redistribute_is_differentiable, mesh_name, async_op):
        assert failures == []


def _case_local_round_trip():
    m = mesh("1d4")
    failures = []
    full = rand((6, 5), seed=5)
    # from_local -> ops -> to_local, with gradients reaching the local tensors
    local = full.chunk(4)[m.get_local_rank()].clone() if m.get_local_rank() < 3 else full[6:].clone()
    local.requires_grad_()
    x = vescale.DTensor.from_local(local, m, [Shard(0)], run_check=True)
    if tuple(x.shape) != (6, 5):
        failures.append(f"from_local(run_check) global shape {tuple(x.shape)}")
    (x.full_tensor() * 2).sum().backward()
    if mismatch(local.grad, torch.full_like(local, 2.0)):
        failures.append("from_local/full_tensor grad")
    # to_local shares storage and is differentiable back into the DTensor
    y = make_dtensor(full, m, [Shard(1)], requires_grad=True)
    (y.to_local() ** 2).sum().backward()
    if mismatch(y.grad.full_tensor(), 2 * full):
        failures.append("to_local grad")
    z = make_dtensor(full, m, [Replicate()])
    z.to_local().add_(1)
    if mismatch(z.full_tensor(), full + 1):
        failures.append("to_local does not share storage")
    # from_local assumes even shards without shape/run_check
    even = vescale.DTensor.from_local(torch.ones(2, 3), m, [Shard(0)])
    if tuple(even.shape) != (8, 3):
        failures.append(f"from_local even global shape {tuple(even.shape)}")
    # an expanded shard stays a broadcast that shares its memory, as torch's from_local
    # keeps it (it was copied dense, so the round trip missed later writes to its source)
    row = rand((1, 5), seed=7)
    shard = row.expand(2, 5)
    wide = vescale.DTensor.from_local(shard, m, [Shard(0)])
    if tuple(wide.stride()) != (0, 1) or wide.to_local().data_ptr() != row.data_ptr():
        failures.append(f"from_local of an expanded shard: strides {tuple(wide.stride())}, copied")
    row.mul_(3)
    if mismatch(wide.full_tensor(), row.expand(8, 5)):
        failures.append("from_local of an expanded shard does not follow its source")
    return failures


def test_local_round_trip(pool4):
    for failures in pool4.run(_case_local_round_trip):
        assert failures == []


def _case_distribute_tensor_broadcasts_from_source():
    m = mesh("2d")
    rank = torch.distributed.get_rank()
    mine = torch.full((4, 4), float(rank))  # ranks disagree; rank 0's copy wins
    x = vescale.distribute_tensor(mine, m, [Shard(0), Shard(1)])
    y = vescale.distribute_tensor(mine, m, [Replicate(), Replicate()], src_data_rank=None)
    w = torch.ones(3, requires_grad=True)
    leaf = vescale.distribute_tensor(w, m, [Replicate(), Shard(0)])
    return (x.full_tensor().unique().tolist(), y.to_local().unique().tolist(), leaf.is_leaf, leaf.requires_grad)


def test_distribute_tensor(pool4):
    for rank, (values, own, is_leaf, requires_grad) in enumerate(pool4.run(_case_distribute_tensor_broadcasts_from_source)):
        assert values == [0.0]
        assert own == [float(rank)]
        assert is_leaf and requires_grad


def _case_partial_over_every_dim_is_one_all_reduce():
    m = mesh("2d")
    full = rand((5, 3), seed=5)
    counts = {}
    for name, src in [("sum,sum", [Partial(), Partial()]), ("sum,max", [Partial(), Partial("max")]),
                      ("sum,shard", [Partial(), Shard(0)])]:
        x = make_dtensor(full, m, src, seed=6)
        vescale.reset_collective_counts()
        y = x.redistribute(m, [Replicate(), src[1] if src[1].is_shard() else Replicate()])
        counts[name] = (vescale.collective_counts()["all_reduce"], mismatch(y.full_tensor(), full))
    return counts, full.numel() * full.element_size()


def test_partial_over_every_dim_is_one_all_reduce(pool4):
    """[Partial, Partial] over a 2x2 mesh of every rank: one all-reduce through the world
    group (same reduce op only), not one per mesh dim; the values are checked too."""
    for counts, local_bytes in pool4.run(_case_partial_over_every_dim_is_one_all_reduce):
        assert counts["sum,sum"] == ((1, local_bytes), None)
        # two reduce ops: one per dim; the max carries a NaN flag beside each value (twice the bytes)
        assert counts["sum,max"] == ((2, 3 * local_bytes), None)
        assert counts["sum,shard"][0][0] == 1 and counts["sum,shard"][1] is None


def _case_partial_over_a_sub_mesh_is_one_all_reduce():
    m = vescale.DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
    full = rand((6, 5), seed=7)
    out = {}
    for names in [("PP", "DP", "TP"), ("DP", "TP"), ("PP", "TP"), ("DP",)]:
        sub = m[names] if len(names) < 3 else m
        x = make_dtensor(full, sub, [Partial()] * len(names), seed=8)
        vescale.reset_collective_counts()
        y = x.redistribute(sub, [Replicate()] * len(names))
        out[names] = (vescale.collective_counts()["all_reduce"], mismatch(y.full_tensor(), full))
    return out, full.numel() * full.element_size()


def test_partial_over_a_sub_mesh_is_one_all_reduce(pool8):
    """On a 2x2x2 mesh of 8 ranks, [Partial, Partial] over a 2-d sub-mesh (adjacent dims or
    not) that spans 4 of the 8 ranks is one all-reduce through the group the mesh created
    for those dims; over the whole mesh, one through the world; the values are checked."""
    for out, local_bytes in pool8.run(_case_partial_over_a_sub_mesh_is_one_all_reduce):
        for names, (counts, bad) in out.items():
            assert bad is None, (names, bad)
            assert counts == (1, local_bytes), (names, counts)


def _case_two_d_meshes_of_part_of_the_world():
    """Two 2x2 meshes over halves of an 8-rank world, created on every rank (the ranks
    outside one take part in creating its groups and get no coordinate)."""
    full = rand((6, 5), seed=9)
    out = {}
    for name, ranks in [("low", torch.arange(4).reshape(2, 2)), ("high", torch.arange(4, 8).reshape(2, 2))]:
        m = vescale.DeviceMesh("cpu", ranks, mesh_dim_names=("DP", "TP"))
        if m.get_coordinate() is None:
            out[name] = "outside"
            continue
        x = make_dtensor(full, m, [Partial(), Partial()], seed=10)
        vescale.reset_collective_counts()
        y = x.redistribute(m, [Replicate(), Replicate()])
        out[name] = (vescale.collective_counts()["all_reduce"][0], mismatch(y.full_tensor(), full))
    return out


def test_two_d_meshes_of_part_of_the_world(pool8):
    """Creating a 2-d mesh that leaves ranks out once raised IndexError on those ranks;
    on its own ranks, [Partial, Partial] is one all-reduce through the flat group."""
    for rank, out in enumerate(pool8.run(_case_two_d_meshes_of_part_of_the_world)):
        inside, outside = ("low", "high") if rank < 4 else ("high", "low")
        assert out[outside] == "outside"
        assert out[inside] == (1, None), (rank, out)


def _no_failures_on_any_rank(results):
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"


def _case_one_partial_value_one_set_of_bits():
    """A Partial value reduced by redistribute() (directly, or through its detach(), as
    vescale.save does) and by an op that needs another layout (a reduce-scatter route)
    gives the same bits: the first reduction is kept and serves both. The sums of the
    two routes differ in their last bits otherwise, and `x > x_saved` came out True
    where one device has a tie (chain seed 68000670)."""
    m = mesh("2d")
    full = rand((6, 5), 3)
    failures = []
    for first in ("redistribute", "detach", "full_tensor"):
        p = make_dtensor(full, m, [Partial(), Partial()], seed=11)
        if first == "redistribute":
            whole = p.redistribute(m, [Replicate(), Replicate()])
        elif first == "detach":
            whole = p.detach().redistribute(m, [Replicate(), Replicate()])
        else:
            whole = vescale.distribute_tensor(p.full_tensor(), m, [Replicate(), Replicate()])
        rows = whole.redistribute(m, [Replicate(), Shard(0)])  # the op moves p to this layout
        ties = (p == rows).full_tensor()
        if not bool(ties.all()):
            failures.append(f"{first}: {int((~ties).sum())} of {ties.numel()} elements differ between the routes")
    return failures


def test_one_partial_value_one_set_of_bits(pool4):
    _no_failures_on_any_rank(pool4.run(_case_one_partial_value_one_set_of_bits))


def _case_redistributed_partials_are_tensors_of_their_own():
    """The kept reduction that redistribute() hands out is the caller's: a write into it
    (through the engine or through to_local) is not served to the next consumer, two
    redistributions of one Partial value do not alias each other, and an in-place op on
    the source (which needs its reduced value, and once wrote into the kept tensor)
    leaves the handed-out one alone."""
    m = mesh("2d")
    full = rand((4, 3), 5)
    failures = []
    p = make_dtensor(full, m, [Partial(), Partial()], seed=2) * 1  # an op's result
    a = p.redistribute(m, [Replicate(), Replicate()])
    p.exp_()
    for name, got, want in (("a after p.exp_()", a.full_tensor(), full), ("p", p.full_tensor(), full.exp())):
        if (err := mismatch(got, want)) is not None:
            failures.append(f"{name}: {err}")
    for write in ("engine", "to_local"):
        p = make_dtensor(full, m, [Partial(), Partial()], seed=2)
        a = p.redistribute(m, [Replicate(), Replicate()])
        b = p.redistribute(m, [Replicate(), Replicate()])
        if write == "engine":
            a.add_(100.0)
        else:
            a.to_local().add_(100.0)
        for name, got, want in (("a", a.full_tensor(), full + 100), ("b", b.full_tensor(), full),
                                ("p, reduced again", p.redistribute(m, [Replicate(), Shard(1)]).full_tensor(), full),
                                ("p in an op", (p * 2).full_tensor(), full * 2)):
            err = mismatch(got, want)
            if err:
                failures.append(f"write through {write}, {name}: {err}")
    return failures


def test_redistributed_partials_are_tensors_of_their_own(pool4):
    _no_failures_on_any_rank(pool4.run(_case_redistributed_partials_are_tensors_of_their_own))


def _case_a_write_through_a_views_shard_reaches_its_base():
    """A Partial value's kept reduction is dropped by a write through the shard of a
    view of it (`x.view(...)`, `x.detach()`, then `.to_local().add_(...)`): a view's
    shard counts writes with its base's, as torch views do. The views' shards had
    counters of their own, so `x.exp()` after such a write used the old reduction."""
    m = mesh("1d4")
    failures = []
    for how in ("view", "detach", "reshape of a detach"):
        x = vescale.DTensor.from_local(torch.ones(3, dtype=torch.float64), m, [Partial()])
        x.exp()  # keeps the reduction
        w = x.view(3) if how == "view" else x.detach() if how == "detach" else x.detach().reshape(1, 3)
        w.to_local().add_(10.0)
        got = x.exp().full_tensor()
        want = torch.full((3,), 4.0 + 40.0, dtype=torch.float64).exp()
        if (err := mismatch(got, want)) is not None:
            failures.append(f"{how}: {err}")
    return failures


def test_a_write_through_a_views_shard_reaches_its_base(pool4):
    _no_failures_on_any_rank(pool4.run(_case_a_write_through_a_views_shard_reaches_its_base))
