"""Random fills draw only the local block on the CPU (the Mersenne Twister jumps or
streams past the rest), with the values and the generator state after the op of a
single-device run: boxes of every shape (the normal_ 16-groups and its redrawn last 16
included), uneven shards, 2-D meshes, InterleavedShard, and a count of drawn elements
that shows a dropout under sequence parallelism draws about its local block only."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import vescale
from vescale import InterleavedShard, Replicate, Shard, _C

from dist_utils import mesh


# ---- one process: the box drawer against whole draws ---------------------------------------

def _whole(kind, a, b, shape, dtype, seed):
    torch.manual_seed(seed)
    t = torch.empty(shape, dtype=dtype)
    getattr(t, kind)(a, b)
    return t, torch.get_rng_state()


BOXES = {  # shape -> boxes (offsets, sizes)
    (1000,): [((0,), (1000,)), ((0,), (250,)), ((250,), (250,)), ((993,), (7,)), ((984,), (16,)), ((3,), (1,))],
    (17,): [((0,), (17,)), ((1,), (16,)), ((16,), (1,)), ((0,), (1,))],
    (16,): [((0,), (16,)), ((5,), (3,))],
    (37, 53): [((0, 0), (37, 53)), ((10, 0), (9, 53)), ((0, 13), (37, 14)), ((36, 40), (1, 13)), ((5, 7), (20, 1))],
    (6, 5, 33): [((2, 0, 0), (2, 5, 33)), ((0, 1, 8), (6, 3, 9)), ((5, 4, 30), (1, 1, 3))],
    (3, 2100, 700): [((1, 0, 0), (1, 2100, 700)), ((0, 0, 175), (3, 2100, 175)), ((2, 1500, 0), (1, 600, 700))],
}


@pytest.mark.parametrize("kind,a,b", [("normal_", 0.5, 2.0), ("uniform_", -1.0, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_box_equals_the_whole_draw_and_leaves_the_same_state(kind, a, b, dtype):
    failures = []
    for shape, boxes in BOXES.items():
        if dtype == torch.float64 and len(shape) == 3 and shape[1] > 1000:
            continue  # the big shape once is enough
        full, after = _whole(kind, a, b, shape, dtype, seed=11)
        for offsets, sizes in boxes:
            torch.manual_seed(11)
            out = torch.empty(sizes, dtype=dtype)
            assert _C._rng_draw_box(kind, a, b, list(shape), list(offsets), list(sizes), out)
            want = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            if not torch.equal(out, want):
                failures.append(f"{shape} {offsets} {sizes}: values")
            if not torch.equal(torch.get_rng_state(), after):
                failures.append(f"{shape} {offsets} {sizes}: generator state")
    assert failures == []


def test_short_normal_and_half_precision_are_left_to_the_whole_draw():
    out = torch.empty(15)
    assert not _C._rng_draw_box("normal_", 0.0, 1.0, [15], [0], [15], out)  # Box-Muller caches a sample
    out = torch.empty(40, dtype=torch.bfloat16)
    assert not _C._rng_draw_box("normal_", 0.0, 1.0, [40], [0], [40], out)  # other group structure


def test_skip_equals_the_whole_fill():
    for kind, dtype, n in [("normal_", torch.float32, 1000003), ("uniform_", torch.float64, 777),
                           ("normal_", torch.float64, 48)]:
        _, after = _whole(kind, 0.0, 1.0, (n,), dtype, seed=3)
        torch.manual_seed(3)
        assert _C._rng_skip(kind, dtype, n)
        assert torch.equal(torch.get_rng_state(), after), (kind, dtype, n)


@pytest.mark.parametrize("n", [0, 1, 623, 624, 625, 10**6, 3 * 10**7 + 11])
def test_jump_and_stream_reach_the_same_state(n):
    torch.manual_seed(5)
    torch.rand(7)
    start = torch.get_rng_state()
    _C._rng_advance(n, "jump")
    jumped = torch.get_rng_state()
    torch.set_rng_state(start)
    _C._rng_advance(n, "stream")
    assert torch.equal(jumped, torch.get_rng_state())
    if n <= 10**6:  # and both are what drawing n 32-bit numbers does
        torch.set_rng_state(start)
        torch.empty(n).uniform_()
        assert torch.equal(jumped, torch.get_rng_state())


# ---- DTensors on 4 ranks ---------------------------------------------------------------------

FILLS = {
    "normal_": lambda x: x.normal_(1.0, 2.0),
    "uniform_": lambda x: x.uniform_(-1, 1),
    "bernoulli_": lambda x: x.bernoulli_(0.3),
    "random_": lambda x: x.random_(0, 1000),
    "random_plain": lambda x: x.random_(),
    "dropout": lambda x: F.dropout(x, p=0.4, training=True),
    "native_dropout": lambda x: torch.ops.aten.native_dropout(x, 0.3, True)[0],
}

# mesh name -> (shape, placements); (13, 29) is uneven over 2 and 4 and has 377 elements
# (normal_ redraws its last 16); InterleavedShard needs the dim to divide (13 x 24: 312)
LAYOUTS = {
    "1d4": [((13, 29), [Shard(0)]), ((13, 29), [Shard(1)]), ((13, 29), [Replicate()]),
            ((13, 24), [InterleavedShard(1, 3)])],
    "2d": [((13, 29), [Shard(0), Shard(1)]), ((13, 29), [Shard(1), Shard(0)]), ((13, 29), [Shard(1), Shard(1)]),
           ((13, 29), [Replicate(), Shard(0)]), ((13, 24), [Shard(0), InterleavedShard(1, 3)])],
}


def _case_fills(mesh_name: str, dtype_name: str) -> list[str]:
    m = mesh(mesh_name)
    dtype = getattr(torch, dtype_name)
    failures = []
    for (name, fn), (shape, placements) in itertools.product(FILLS.items(), LAYOUTS[mesh_name]):
        full = torch.ones(shape, dtype=dtype)
        torch.manual_seed(77)
        torch.rand(3)  # start mid-block
        expected = fn(full.clone())
        state_after = torch.get_rng_state()
        torch.manual_seed(77)
        torch.rand(3)
        with torch.no_grad():
            out = fn(vescale.distribute_tensor(full.clone(), m, placements))
        if not torch.equal(out.full_tensor(), expected):
            failures.append(f"{name} {placements}: values")
        if not torch.equal(torch.get_rng_state(), state_after):
            failures.append(f"{name} {placements}: generator state after the op")
    return failures


@pytest.mark.parametrize("mesh_name", ["1d4", "2d"])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_fills_match_single_device_values_and_state(pool4, mesh_name, dtype_name):
    for failures in pool4.run(_case_fills, mesh_name, dtype_name):
        assert failures == []


def _native_dropout_differences(x, m, placements, p, view=lambda t: t) -> list[str]:
    """Where native_dropout of view(x distributed) differs from one device's (output, mask)."""
    torch.manual_seed(5)
    expected = torch.ops.aten.native_dropout(view(x), p, True)
    torch.manual_seed(5)
    with torch.no_grad():
        out = torch.ops.aten.native_dropout(view(vescale.distribute_tensor(x, m, placements)), p, True)
    return [what for what, o, e in zip(("output", "mask"), out, expected) if not torch.equal(o.full_tensor(), e)]


def _case_low_precision_dropout(mesh_name: str) -> list[str]:
    # p = 0.1 scales by 1 / 0.9, which bfloat16 and float16 cannot hold: native_dropout
    # (F.dropout's kernel on CUDA) computes input * mask * scale in float and rounds
    # once, and a sharded one must too (the InterleavedShard layouts draw the whole mask,
    # the others their block)
    m = mesh(mesh_name)
    failures = []
    for dtype, (shape, placements) in itertools.product([torch.bfloat16, torch.float16], LAYOUTS[mesh_name]):
        torch.manual_seed(4)  # the same input on every rank
        x = torch.randn(shape).to(dtype)
        failures += [f"{dtype} {placements}: {what}" for what in _native_dropout_differences(x, m, placements, 0.1)]
    return failures


@pytest.mark.parametrize("mesh_name", ["1d4", "2d"])
def test_low_precision_dropout_rounds_once_as_the_op_does(pool4, mesh_name):
    for failures in pool4.run(_case_low_precision_dropout, mesh_name):
        assert failures == []


def _case_dropout_of_a_transposed_value(mesh_name: str) -> list[str]:
    # native_dropout draws its mask in the input's memory order (empty_like keeps a
    # permuted layout); a sharded one of a transposed value must too
    m = mesh(mesh_name)
    failures = []
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]) if m.ndim == 1 else ([Shard(0), Shard(1)],):
        torch.manual_seed(4)
        x = torch.randn(12, 40)
        failures += [f"{placements}: {what}"
                     for what in _native_dropout_differences(x, m, placements, 0.3, view=lambda t: t.t())]
    return failures


@pytest.mark.parametrize("mesh_name", ["1d4", "2d"])
def test_dropout_of_a_transposed_value_draws_in_its_memory_order(pool4, mesh_name):
    for failures in pool4.run(_case_dropout_of_a_transposed_value, mesh_name):
        assert failures == []


def _case_refused_fills() -> list[str]:
    m = mesh("1d4")
    failures = []
    for name, fn in [("uniform_", lambda t: t.uniform_(3.0, 1.0)), ("normal_", lambda t: t.normal_(0.0, -1.0)),
                     ("bernoulli_", lambda t: t.bernoulli_(2.0)), ("random_", lambda t: t.random_(5, 2)),
                     ("native_dropout", lambda t: torch.ops.aten.native_dropout(t, 1.5, True))]:
        d = vescale.distribute_tensor(torch.zeros(64, 40), m, [Shard(0)])
        before = torch.get_rng_state()
        vescale.debug.reset_fallback_counts()
        try:
            fn(d)
            failures.append(f"{name}: no error")
        except RuntimeError as e:
            if name.rstrip("_") not in str(e) and "expects" not in str(e):
                failures.append(f"{name}: {e}")
        if not torch.equal(torch.get_rng_state(), before):
            failures.append(f"{name}: the refused fill moved the generator")
        if vescale.debug.fallback_counts():  # torch's error, not a gather through the fallback first
            failures.append(f"{name}: went through the replicate fallback {vescale.debug.fallback_counts()}")
    return failures


def test_a_refused_fill_leaves_every_ranks_generator_alone(pool4):
    # the box drawer jumps to the block's start before the fill runs: torch's argument
    # checks must come first, or the ranks' generators fall out of step
    for failures in pool4.run(_case_refused_fills):
        assert failures == []


def _case_sequence_parallel_dropout() -> dict:
    m = mesh("1d4")
    x = torch.randn(512, 64)  # (sequence, hidden), the sequence split: sequence parallelism
    torch.manual_seed(3)
    expected = F.dropout(x, p=0.1, training=True)
    torch.manual_seed(3)
    dx = vescale.distribute_tensor(x, m, [Shard(0)])
    _C._rng_reset_drawn_elements()
    out = F.dropout(dx, p=0.1, training=True)
    drawn = _C._rng_drawn_elements()
    return dict(equal=torch.equal(out.full_tensor(), expected), drawn=drawn, local=dx.to_local().numel())


def test_sequence_parallel_dropout_draws_the_local_block(pool4):
    for r in pool4.run(_case_sequence_parallel_dropout):
        assert r["equal"]
        assert r["drawn"] == r["local"], r  # not the whole 512 x 64


# ---- deferred_init: three Linear(2000, 2000) over 4 ranks ------------------------------------

class Three(torch.nn.Module):
    def __init__(self, init: str = "normal_"):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2000, 2000, bias=False) for _ in range(3))
        for layer in self.layers:  # an _init_weights pass after nn.Linear's kaiming_uniform_
            if init == "normal_":
                torch.nn.init.normal_(layer.weight, std=0.02)
            elif init == "trunc_normal_":  # bounds at 1.5 std: 13% of the first draws rejected, several rounds
                torch.nn.init.trunc_normal_(layer.weight, std=0.02, a=-0.03, b=0.03)
            else:  # torchtitan's: bounds at +-2, 100 std: nothing is ever rejected
                torch.nn.init.trunc_normal_(layer.weight, std=0.02)


def _case_deferred_three(placement_dim: int, init: str) -> dict:
    import ctypes
    import gc

    from vescale.deferred import deferred_init
    from vescale.parallel import parallelize_module

    m = mesh("1d4")
    deferred_init(Three, init)  # the first dispatch mode loads library code: not model memory
    torch.manual_seed(0)
    ref = Three(init)
    ref_next = torch.rand(3)
    del ref
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        base = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    torch.manual_seed(0)
    _C._rng_reset_drawn_elements()
    model = deferred_init(Three, init)
    recorded_draws = _C._rng_drawn_elements()
    after_record = torch.rand(3)
    parallelize_module(model, m, {"parameter": {r"layers\.\d+\.weight": [Shard(placement_dim)]}})
    drawn = _C._rng_drawn_elements()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) - base
    torch.manual_seed(0)
    ref = Three(init)
    equal = all(torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), ref.parameters()))
    local = sum(p.to_local().numel() for p in model.parameters())
    return dict(equal=equal, same_next=torch.equal(after_record, ref_next),
                recorded_draws=recorded_draws, drawn=drawn, local=local, peak_kb=peak, local_kb=local * 4 // 1024)


@pytest.mark.parametrize("init", ["normal_", "trunc_normal_wide"])
@pytest.mark.parametrize("placement_dim", [0, 1])
def test_deferred_linears_draw_and_hold_only_the_shard(pool4, placement_dim, init):
    """Bitwise single-device values; recording draws nothing; each rank draws its shard
    (rounded to normal_'s groups of 16: at most one group per row of a column shard) and
    peaks at its shard plus one 4 MiB chunk and a constant (the whole model is 48 MB, a
    shard 12 MB). A trunc_normal_ whose bounds lie beyond what normal_ can draw is one
    normal_ fill, drawn the same way."""
    for r in pool4.run(_case_deferred_three, placement_dim, init):
        assert r["equal"] and r["same_next"], r
        assert r["recorded_draws"] == 0, r
        assert r["local"] <= r["drawn"] <= r["local"] + 3 * 2000 * 32, r
        assert r["peak_kb"] < r["local_kb"] + 10 * 1024, r


@pytest.mark.parametrize("placement_dim", [0, 1])
def test_deferred_trunc_normal_holds_only_the_shard(pool4, placement_dim):
    """trunc_normal_ (a rejection sampler: rounds of whole-tensor normal_ until every
    element is inside the bounds) is streamed round by round in chunks, the elements still
    rejected kept as bits: single-device values and generator state, and a peak of the
    shard plus a chunk, its masks and the bits (a tensor is 16 MB; replaying one whole,
    as before, peaked above 30 MB over the shard)."""
    for r in pool4.run(_case_deferred_three, placement_dim, "trunc_normal_"):
        assert r["equal"] and r["same_next"], r
        assert r["peak_kb"] < r["local_kb"] + 12 * 1024, r
