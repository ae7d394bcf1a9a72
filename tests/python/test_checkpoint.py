"""vescale.save / vescale.load: a checkpoint saved on one mesh, world size and ZeRO stage
loads into another with every parameter bitwise equal to the saved global tensor, and
training resumed from it gives the losses of an uninterrupted single-device run on
the same global batches (fp32, rtol 1e-5). Also: async save; non-tensor state
round-trips exactly without pickle (values that need pickle are refused at save); each
rank's random stream; Partial tensors. Damaged and crafted checkpoints are in
test_checkpoint_faults.py, Hugging Face and torch state dicts in
test_checkpoint_interop.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import vescale

from dist_utils import mesh, mismatch
from test_parallel import LAYOUTS
from examples.models.gpt import GPT, GPTConfig
from checkpoint_runs import CONFIG, STEPS_BEFORE, WORLD, _batches, _optimizer, _schedule, _Run

# (saved from, loaded into): other meshes, world sizes and ZeRO stages
MATRIX = [
    ("dp2_tp2", "tp4"),
    ("zero1_dp4", "dp2_tp2_sp"),
    ("tp4", "tp2"),
    ("zero1_dp4", "zero3_dp4"),
    ("zero3_dp4", "dp2"),
    ("tp2", "zero2_dp2_tp2"),
]


def _reference() -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    opt = _optimizer(model.parameters(), 0)
    sched = _schedule(opt)
    losses = []
    for idx, tgt in _batches():
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _case_save(layout: str, path: str) -> list[float]:
    run = _Run(layout, seed=0)
    losses = run.train(_batches()[:STEPS_BEFORE])
    vescale.save(path, run.state())
    full = run.full_parameters()
    full["__draw_after_save__"] = torch.rand(3)  # the RNG state is saved too
    if dist.get_rank() == 0:
        torch.save(full, path + ".params.pt")
    dist.barrier()
    return losses


def _case_resume(layout: str, path: str) -> tuple[list[str], list[float]]:
    run = _Run(layout, seed=1)  # other initial values: everything must come from the checkpoint
    vescale.load(path, run.state())
    saved = torch.load(path + ".params.pt")
    failures = [f"{n}: not bitwise equal to the saved tensor" for n, p in run.full_parameters().items()
                if not torch.equal(p, saved[n])]
    if not torch.equal(torch.rand(3), saved["__draw_after_save__"]):
        failures.append("the RNG state was not restored")
    if run.sched.last_epoch != STEPS_BEFORE:
        failures.append(f"scheduler at step {run.sched.last_epoch}, saved at {STEPS_BEFORE}")
    return failures, run.train(_batches()[STEPS_BEFORE:])


@pytest.mark.parametrize("src,dst", MATRIX, ids=[f"{s}-to-{d}" for s, d in MATRIX])
def test_resume_on_another_layout_matches_single_device(pool2, pool4, tmp_path, src, dst):
    pools = {2: pool2, 4: pool4}
    path = str(tmp_path / "ckpt")
    before = pools[WORLD[LAYOUTS[src][0]]].run(_case_save, src, path)[0]
    answers = pools[WORLD[LAYOUTS[dst][0]]].run(_case_resume, dst, path)
    ref = _reference()
    assert mismatch(torch.tensor(before), torch.tensor(ref[:STEPS_BEFORE]), rtol=1e-5, atol=1e-6) is None
    for failures, after in answers:
        assert failures == []
        err = mismatch(torch.tensor(after), torch.tensor(ref[STEPS_BEFORE:]), rtol=1e-5, atol=1e-6)
        assert err is None, f"resumed losses {after} vs uninterrupted {ref[STEPS_BEFORE:]}: {err}"


# ---- async save -------------------------------------------------------------------------------

def _case_async(path: str) -> list[str]:
    run = _Run("dp2_tp2", seed=0)
    run.train(_batches()[:1])
    at_save = run.full_parameters()
    vescale.save(path, run.state(), async_save=True)
    run.train(_batches()[1:3])  # training goes on while the snapshot is written
    vescale.checkpoint.wait()
    other = _Run("tp4", seed=1)
    vescale.load(path, other.state())
    return [n for n, p in other.full_parameters().items() if not torch.equal(p, at_save[n])]


def test_async_save_writes_the_snapshot(pool4, tmp_path):
    assert pool4.run(_case_async, str(tmp_path / "ckpt")) == [[]] * 4


# ---- non-tensor state without pickle ----------------------------------------------------------

USER_VALUES = {"step": 7, "ratio": 0.1, "big": 2**70, "minus zero": -0.0, "inf": float("inf"),
               "nan": float("nan"), "name": "ünïcode", "flags": [True, False, None], "pair": (1, (2.5, "x")),
               "by number": {3: "three", 0.5: [1], None: {}}, "__vescale__": {"__vescale__": "tensor"},
               "tensors": [torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2], dtype=torch.bfloat16),
                           torch.tensor(True)]}


def _identical(a, b) -> bool:
    """Equal, and of the same types all the way down (a tuple stays a tuple, NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    return repr(a) == repr(b)  # -0.0 and nan too


def _case_round_trip(path: str) -> list[str]:
    run = _Run("tp2", seed=0)
    run.train(_batches()[:2])
    vescale.save(path, {**run.state(), "user": USER_VALUES, "epoch": 3})
    drawn = torch.rand(3)
    target = _Run("tp2", seed=1)
    state = {**target.state(), "user": None, "epoch": 0}
    vescale.load(path, state)
    failures = [] if torch.equal(torch.rand(3), drawn) else ["RNG state"]
    if not _identical(target.sched.state_dict(), run.sched.state_dict()):
        failures.append(f"scheduler {target.sched.state_dict()} != {run.sched.state_dict()}")
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in (target.opt, run.opt)]
    if not _identical(*groups):
        failures.append(f"param groups {groups[0]} != {groups[1]}")
    if not _identical(state["user"], USER_VALUES) or state["epoch"] != 3:
        failures.append(f"user values {state['user']}, epoch {state['epoch']}")
    return failures


def test_scheduler_param_groups_rng_and_user_values_round_trip_exactly(pool2, tmp_path):
    assert pool2.run(_case_round_trip, str(tmp_path / "ckpt")) == [[]] * 2


def _case_rng_save(path: str, apart: bool) -> list[float]:
    """Seeds the ranks apart (or alike), saves, and returns what each draws next."""
    import torch.distributed as dist

    run = _Run("tp2", seed=0)
    torch.manual_seed(100 + dist.get_rank() if apart else 100)
    vescale.save(path, run.state())
    return torch.rand(3).tolist()


def _case_rng_load(path: str, layout: str) -> tuple[list[float], list[str]]:
    import warnings

    run = _Run(layout, seed=1)
    torch.manual_seed(12345)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vescale.load(path, run.state())
    return torch.rand(3).tolist(), [str(w.message) for w in caught if "random state" in str(w.message)]


@pytest.mark.parametrize("apart", [True, False])
def test_each_rank_resumes_its_own_random_stream(pool2, pool4, tmp_path, apart):
    """A program that seeds its ranks apart gets each rank's own CPU random state back (all
    of them used to take rank 0's); on another world size such states cannot be mapped and
    are left alone, with a warning. Ranks seeded alike resume that one stream anywhere."""
    path = str(tmp_path / "ckpt")
    drawn = pool2.run(_case_rng_save, path, apart)
    assert (drawn[0] != drawn[1]) == apart
    assert [d for d, _ in pool2.run(_case_rng_load, path, "tp2")] == drawn
    elsewhere = pool4.run(_case_rng_load, path, "tp4")
    if apart:
        assert all(len(w) == 1 and "each of its 2 ranks, and this job has 4" in w[0] for _, w in elsewhere)
        untouched = torch.Generator().manual_seed(12345)
        expected = torch.rand(3, generator=untouched).tolist()
        assert all(d == expected for d, _ in elsewhere)  # left as it was
    else:
        assert all(d == drawn[0] and not w for d, w in elsewhere)


def _case_unsupported(path: str) -> tuple[str, str]:
    import datetime

    run = _Run("tp2", seed=0)
    value = {"ok": [1, 2], "when": datetime.date(2024, 1, 1)} if dist.get_rank() == 1 else {"ok": [1, 2]}
    try:
        vescale.save(path, {**run.state(), "user": value})
    except TypeError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_values_that_need_pickle_are_refused_at_save(pool2, tmp_path):
    path = str(tmp_path / "ckpt")
    answers = pool2.run(_case_unsupported, path)  # rank 1 alone has the bad value: both raise
    assert answers[0] == answers[1] and answers[0][0] == "TypeError", answers
    assert "cannot save 'user'['when']: a datetime.date" in answers[0][1], answers[0][1]
    assert "found by rank 1" in answers[0][1] and os.listdir(tmp_path) == [], answers[0][1]


# ---- Partial tensors --------------------------------------------------------------------------

def _case_partial_tensors(path: str) -> list[str]:
    """A Partial DTensor's shards are addends: a checkpoint holds their reduction, and a
    load into a Partial target gives it the value as addends again (fuzz seeds 47000041,
    47000066: saved as one rank's addend, and loaded into every rank's shard, a
    Partial(sum) target held the value twice)."""
    from dist_utils import make_dtensor
    from vescale import Partial, Replicate, Shard

    m = mesh("2d")
    value = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sources = ([Replicate(), Replicate()], [Partial(), Shard(0)], [Shard(1), Partial("avg")],
               [Partial(), Partial()], [Partial("max"), Replicate()])
    targets = ([Shard(0), Replicate()], [Partial(), Replicate()], [Partial("avg"), Shard(1)],
               [Partial(), Partial("max")], [Replicate(), Partial()])
    failures = []
    for k, source in enumerate(sources):
        saved = make_dtensor(value, m, source, seed=k)  # Partial shards hold different addends
        for j, placements in enumerate(targets):
            target = vescale.distribute_tensor(torch.full((5, 3), 7.0, dtype=torch.float64), m, placements)
            vescale.save(f"{path}_{k}_{j}", {"x": saved})
            vescale.load(f"{path}_{k}_{j}", {"x": target})
            if (bad := mismatch(target.full_tensor(), value)) is not None:
                failures.append(f"{source} -> {placements}: {bad}")
            if list(target.placements) != list(placements):
                failures.append(f"{source} -> {placements}: placements became {target.placements}")
        if (bad := mismatch(saved.full_tensor(), value)) is not None:
            failures.append(f"{source}: the saved tensor changed: {bad}")
    return failures


def test_partial_tensors_save_their_value_and_load_as_addends(pool4, tmp_path):
    assert pool4.run(_case_partial_tensors, str(tmp_path / "ckpt")) == [[]] * 4
