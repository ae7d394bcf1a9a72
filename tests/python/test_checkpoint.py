"""vescale.save / vescale.load: a checkpoint saved on one mesh, world size and ZeRO stage
loads into another with every parameter bitwise equal to the saved global tensor, and
training resumed from it gives the losses of an uninterrupted single-device run on
the same global batches (fp32, rtol 1e-5). Also: async save, crash mid-save, the
temporary directories of crashed saves, a manifest that does not fit the target, and
checkpoints that cannot be trusted: damaged or truncated files (every rank raises the
same error and none changes anything), pickles planted in them (never run), and file
names that lead outside the checkpoint; non-tensor state round-trips exactly without
pickle."""

from __future__ import annotations

import json
import os
import re
import time
import zlib

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.checkpoint import CorruptCheckpoint
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.ddp import local_of

from dist_utils import mesh, mismatch
from test_parallel import LAYOUTS
from examples.models.gpt import GPT, GPTConfig
from vescale.parallel.plans import gpt_plan

# vocab 66 and 6 heads of 6: TP4 splits the vocabulary 17/17/17/15 (uneven shards)
CONFIG = dict(vocab_size=66, n_embd=36, n_head=6, bias=False)
GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 4, 3, 3
WORLD = {"1d2": 2, "1d4": 4, "2d": 4}

# (saved from, loaded into): other meshes, world sizes and ZeRO stages
MATRIX = [
    ("dp2_tp2", "tp4"),
    ("zero1_dp4", "dp2_tp2_sp"),
    ("tp4", "tp2"),
    ("zero1_dp4", "zero3_dp4"),
    ("zero3_dp4", "dp2"),
    ("tp2", "zero2_dp2_tp2"),
]


def _batches():
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, 17), generator=g)
            for _ in range(STEPS_BEFORE + STEPS_AFTER)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _optimizer(params_or_models, zero: int):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    if zero:
        return DistributedOptimizer(torch.optim.AdamW, models=params_or_models, zero_stage=zero, **kwargs)
    return torch.optim.AdamW(params_or_models, **kwargs)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


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


class _Run:
    """One layout of test_parallel.LAYOUTS: model, optimizer, scheduler, this rank's rows."""

    def __init__(self, layout: str, seed: int):
        mesh_name, tp_dim, dp_dim, sp, zero = LAYOUTS[layout]
        m = mesh(mesh_name)
        tp = None if tp_dim is None else (m[tp_dim] if isinstance(tp_dim, str) else m)
        self.dp = None if dp_dim is None else (m[dp_dim] if isinstance(dp_dim, str) else m)
        torch.manual_seed(seed)
        model = GPT(GPTConfig(**CONFIG))
        if tp is not None:
            parallelize_module(model, tp, gpt_plan(sequence_parallel=sp))
        self.model = DDP(model, self.dp) if self.dp is not None else model
        self.zero = zero
        self.opt = _optimizer([self.model] if zero else self.model.parameters(), zero)
        self.sched = _schedule(self.opt)
        size, rank = (self.dp.size(), self.dp.get_local_rank()) if self.dp is not None else (1, 0)
        local = GLOBAL_BATCH // size
        self.rows = slice(rank * local, (rank + 1) * local)

    def state(self) -> dict:
        return {"model": self.model, "optimizer": self.opt, "lr_scheduler": self.sched}

    def train(self, batches) -> list[float]:
        losses = []
        for idx, tgt in batches:
            self.opt.zero_grad()
            loss = self.model(idx[self.rows], tgt[self.rows])
            loss.backward()
            self.opt.step()
            self.sched.step()
            value = loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss.detach().clone()
            if self.dp is not None:
                dist.all_reduce(value, group=self.dp.get_group())
                value /= self.dp.size()
            losses.append(value.item())
        return losses

    def full_parameters(self) -> dict[str, torch.Tensor]:
        inner = self.model.module if isinstance(self.model, DDP) else self.model
        with self.opt.full_parameters() if self.zero else torch.no_grad():
            # full_tensor() of a replicated DTensor is its local tensor: copy, since training goes on
            return {n: (p.full_tensor() if isinstance(p, vescale.DTensor) else p.detach()).clone()
                    for n, p in inner.named_parameters()}


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


# ---- async save, crashes, corruption, mismatches ---------------------------------------------

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


def _case_crash_mid_save(path: str, failing: list[int], async_save: bool) -> list[str]:
    import os
    import torch.distributed as dist
    import vescale.checkpoint.writing as writing

    run = _Run("dp2_tp2", seed=0)
    run.train(_batches()[:1])
    vescale.save(path, run.state())
    good = run.full_parameters()
    run.train(_batches()[1:2])
    real = writing.write_file

    def dies_halfway(file, chunks):
        if dist.get_rank() not in failing:
            return real(file, chunks)
        real(file, chunks[: len(chunks) // 2])
        raise OSError("disk full (simulated)")

    writing.write_file = dies_halfway
    problems = []
    try:
        vescale.save(path, run.state(), async_save=async_save)
        vescale.checkpoint.wait()
        problems.append("the failing save did not raise")
    except (OSError, RuntimeError) as e:  # on every rank, naming the first that failed (async: at wait)
        if not isinstance(e, RuntimeError if async_save else OSError) or f"found by rank {failing[0]}" not in str(e):
            problems.append(f"the error does not name rank {failing[0]}: {e}")
    finally:
        writing.write_file = real
    dist.barrier()
    parent, base = os.path.split(path)
    problems += [f"left behind: {n}" for n in os.listdir(parent) if n.startswith(base + ".tmp-")]
    other = _Run("tp4", seed=1)
    vescale.load(path, other.state())
    return problems + [n for n, p in other.full_parameters().items() if not torch.equal(p, good[n])]


@pytest.mark.parametrize("failing, async_save", [([0, 1, 2, 3], False), ([2], False), ([1], True)])
def test_crash_mid_save_keeps_the_previous_checkpoint(pool4, tmp_path, failing, async_save):
    """A write that fails on some ranks (a full disk, a directory not shared) makes every
    rank raise it (the others used to wait for the failed rank until the collective
    timeout), leaves no unfinished directory, and the previous checkpoint loads."""
    assert pool4.run(_case_crash_mid_save, str(tmp_path / "ckpt"), failing, async_save) == [[]] * 4


# ---- damaged, foreign and crafted checkpoints: every rank raises the same error, none changes --

def _snapshot(run: _Run) -> dict:
    """Everything a load could change on this rank, copied."""
    inner = run.model.module if isinstance(run.model, DDP) else run.model
    out = {f"param {n}": local_of(p.detach()).clone() for n, p in inner.named_parameters()}
    for i, s in enumerate(run.opt.state.values()):
        out.update({f"optimizer state {i} {k}": v.clone() for k, v in s.items()})
    out["optimizer states"] = len(run.opt.state)
    out["param groups"] = [{k: v for k, v in g.items() if k != "params"} for g in run.opt.param_groups]
    out["scheduler"] = run.sched.state_dict()
    out["rng"] = torch.get_rng_state()
    return out


def _changed(before: dict, after: dict) -> list[str]:
    def same(a, b):
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    return sorted(k for k in before.keys() | after.keys() if k not in before or k not in after
                  or not same(before[k], after[k]))


def _flip_byte(file: str, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def _flip_digit(file: str, pattern: bytes) -> None:
    """Turns the last digit that ``pattern``'s group matches into another digit: the
    file still parses, with a different value in it."""
    with open(file, "rb") as f:
        match = re.search(pattern, f.read())
    _flip_byte(file, match.end(1) - 1)


def _truncate(file: str) -> None:
    os.truncate(file, os.path.getsize(file) // 2)


def _largest_data_file(path: str) -> str:
    data = [os.path.join(path, f) for f in os.listdir(path) if f.startswith("data_")]
    return max(data, key=os.path.getsize)


def _flip_in_one_ranks_shard(path: str) -> None:
    """A byte of rank 2's shard of a column-parallel weight, saved by rank 2 into its
    own file: after a TP4 save, only rank 2 of a TP4 load reads it."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    chunk, = [c for c in manifest["tensors"][ONE_RANKS_KEY]["chunks"] if c["file"] == "data_00002.bin"]
    _flip_byte(os.path.join(path, chunk["file"]), chunk["offset"] + chunk["nbytes"] // 2)


ONE_RANKS_KEY = "model.transformer.h.0.mlp.c_fc.weight"
DAMAGE = {  # name: (damage done to a TP4 checkpoint, what the error on every rank must say)
    "one rank's shard": (_flip_in_one_ranks_shard,
                         [f"data_00002.bin: checksum mismatch in block 0 of '{ONE_RANKS_KEY}'", "found by rank 2;"]),
    "data flipped": (lambda p: _flip_byte(_largest_data_file(p), os.path.getsize(_largest_data_file(p)) // 3),
                     ["checksum mismatch in block 0", "data_0000"]),
    "data truncated": (lambda p: _truncate(_largest_data_file(p)), ["bytes, found", "truncated"]),
    "objects flipped": (lambda p: _flip_digit(os.path.join(p, "objects.json"), rb'"lr": (\d)'),
                        ["objects.json: checksum mismatch"]),
    "objects truncated": (lambda p: _truncate(os.path.join(p, "objects.json")), ["objects.json: expected"]),
    "object tensors flipped": (lambda p: _flip_byte(os.path.join(p, "objects.bin"), 100),
                               ["objects.bin: checksum mismatch in block 0 of 'objects tensor 0'"]),
    "manifest flipped": (lambda p: _flip_digit(os.path.join(p, "manifest.json"), rb'"shape": \[(\d+)'),
                         ["manifest.json: checksum mismatch"]),
    "manifest truncated": (lambda p: _truncate(os.path.join(p, "manifest.json")), ["manifest.json: not valid JSON"]),
}


def _case_load_after(path: str, harm: str) -> tuple[str, str, list[str]]:
    """Saves a trained TP4 run, lets rank 0 do ``harm`` to the checkpoint, loads into a
    fresh TP4 run; returns (error type, message, what the load changed on this rank)."""
    run = _Run("tp4", seed=0)
    run.train(_batches()[:1])
    vescale.save(path, run.state())
    if dist.get_rank() == 0:
        HARM[harm](path)
    dist.barrier()
    target = _Run("tp4", seed=1)  # untrained: a load would also create its optimizer state
    before = _snapshot(target)
    try:
        vescale.load(path, target.state())
        outcome = ("no error", "")
    except Exception as e:  # noqa: BLE001  (the test compares what every rank raised)
        outcome = (type(e).__name__, str(e))
    return (*outcome, _changed(before, _snapshot(target)))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_makes_every_rank_raise_and_none_change(pool4, tmp_path, damage):
    answers = pool4.run(_case_load_after, str(tmp_path / "ckpt"), damage)
    kind, message, _ = answers[0]
    assert kind == "CorruptCheckpoint", answers[0]
    assert all(a == answers[0][:2] + ([],) for a in answers), answers  # the same error everywhere, no change
    for expected in DAMAGE[damage][1]:
        assert expected in message, message
    if damage == "one rank's shard":
        assert "failed too" not in message, message  # only rank 2 read the damaged block


# a pickle that runs os.mkdir(marker) when loaded: the attack that pickled checkpoints allow
class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _edit_manifest(path: str, edit) -> None:
    """Changes the manifest as someone who knows the format would: its checksum fits."""
    from vescale.checkpoint.manifest import _crc_of

    file = os.path.join(path, "manifest.json")
    manifest = json.load(open(file))
    del manifest["crc32"]
    edit(manifest)
    json.dump(dict(manifest, crc32=_crc_of(manifest)), open(file, "w"))


def _pickle_as_objects(path: str) -> None:
    file = os.path.join(path, "objects.json")
    torch.save({"lr_scheduler": _Payload(path + ".pwned")}, file)
    data = open(file, "rb").read()
    _edit_manifest(path, lambda m: m["files"].update({"objects.json": {"nbytes": len(data),
                                                                       "crc32": zlib.crc32(data)}}))


def _pickle_as_manifest(path: str) -> None:
    torch.save(_Payload(path + ".pwned"), os.path.join(path, "manifest.json"))


def _pickled_format(path: str) -> None:
    """What vescale-checkpoint/1 wrote: the objects as a pickle, objects.pt."""
    torch.save({"lr_scheduler": _Payload(path + ".pwned")}, os.path.join(path, "objects.pt"))
    file = os.path.join(path, "manifest.json")
    manifest = json.load(open(file))
    json.dump(dict(manifest, format="vescale-checkpoint/1"), open(file, "w"))


PICKLES = {  # where the pickle is planted: what the error must say
    "objects.json": ("CorruptCheckpoint", "objects.json: malformed"),
    "manifest.json": ("CorruptCheckpoint", "manifest.json: not valid JSON"),
    "objects.pt of format 1": ("ValueError", "an older format whose objects.pt is a pickle"),
}


@pytest.mark.parametrize("where", list(PICKLES))
def test_a_pickle_in_a_checkpoint_never_runs(pool4, tmp_path, where):
    path = str(tmp_path / "ckpt")
    answers = pool4.run(_case_load_after, path, f"pickle in {where}")
    assert not os.path.exists(path + ".pwned"), "the pickle ran"
    kind, message = PICKLES[where]
    assert all(a == answers[0] for a in answers) and answers[0][0] == kind and answers[0][2] == [], answers
    assert message in answers[0][1], answers[0][1]


def _outside(path: str) -> str:
    """Moves data_00000.bin out of the checkpoint directory, bytes intact."""
    outside = os.path.join(os.path.dirname(path), "outside.bin")
    os.rename(os.path.join(path, "data_00000.bin"), outside)
    return outside


def _rename_data_file(path: str, name: str) -> None:
    def edit(manifest):
        manifest["files"][name] = manifest["files"].pop("data_00000.bin")
        for entry in manifest["tensors"].values():
            for chunk in entry["chunks"]:
                if chunk["file"] == "data_00000.bin":
                    chunk["file"] = name
    _edit_manifest(path, edit)


def _escape_relative(path: str) -> None:
    _outside(path)
    _rename_data_file(path, "../outside.bin")


def _escape_absolute(path: str) -> None:
    _rename_data_file(path, _outside(path))


def _escape_symlink(path: str) -> None:
    os.symlink(_outside(path), os.path.join(path, "data_00000.bin"))


ESCAPES = {  # how a file outside the directory is reached: what the error must say
    "relative": (_escape_relative, "refers to the file '../outside.bin', which is not a plain file name"),
    "absolute": (_escape_absolute, "outside.bin', which is not a plain file name"),
    "symlink": (_escape_symlink, "outside.bin, outside "),
}


@pytest.mark.parametrize("how", list(ESCAPES))
def test_manifest_cannot_reach_outside_the_checkpoint(pool4, tmp_path, how):
    answers = pool4.run(_case_load_after, str(tmp_path / "ckpt"), f"escape {how}")
    assert all(a == answers[0] for a in answers) and answers[0][0] == "CorruptCheckpoint", answers
    assert ESCAPES[how][1] in answers[0][1] and answers[0][2] == [], answers[0]


HARM = {**{name: damage for name, (damage, _) in DAMAGE.items()},
        "pickle in objects.json": _pickle_as_objects, "pickle in manifest.json": _pickle_as_manifest,
        "pickle in objects.pt of format 1": _pickled_format,
        **{f"escape {name}": escape for name, (escape, _) in ESCAPES.items()}}


def _case_mismatch(path: str) -> str:
    run = _Run("tp2", seed=0)
    run.train(_batches()[:1])  # so that the optimizer has state
    vescale.save(path, run.state())
    torch.manual_seed(0)
    other = GPT(GPTConfig(**dict(CONFIG, n_embd=48, n_layer=3)))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    try:
        vescale.load(path, {"model": other})
    except ValueError as e:
        unchanged = all(torch.equal(p, before[n]) for n, p in other.named_parameters())
        return str(e) + ("" if unchanged else " [BUT THE MODEL WAS CHANGED]")
    return "no error"


def test_mismatched_target_is_a_clear_error(pool2, tmp_path):
    message = pool2.run(_case_mismatch, str(tmp_path / "ckpt"))[0]
    assert "CHANGED" not in message
    assert "shape [144, 48] here, [108, 36] in the checkpoint" in message, message
    assert "missing in the checkpoint: model.transformer.h.2." in message, message
    assert "not in the state to load: optimizer." in message, message


def _case_one_rank_mismatch(path: str) -> tuple[str, str, list[str]]:
    """Rank 1 alone loads into a state with a key the checkpoint lacks."""
    run = _Run("tp2", seed=0)
    run.train(_batches()[:1])
    vescale.save(path, run.state())
    target = _Run("tp2", seed=1)
    before = _snapshot(target)
    state = target.state() if dist.get_rank() != 1 else {**target.state(), "epoch": 3}
    try:
        vescale.load(path, state)
        outcome = ("no error", "")
    except ValueError as e:
        outcome = (type(e).__name__, str(e))
    return (*outcome, _changed(before, _snapshot(target)))


def test_a_mismatch_on_one_rank_changes_no_rank(pool2, tmp_path):
    answers = pool2.run(_case_one_rank_mismatch, str(tmp_path / "ckpt"))
    assert answers[0] == answers[1], answers
    kind, message, changed = answers[0]
    assert kind == "ValueError" and changed == [], answers[0]
    assert "objects missing in the checkpoint: epoch" in message and "found by rank 1;" in message, message


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


# ---- temporary directories of crashed saves ---------------------------------------------------

def _case_stale_tmp(path: str) -> list[str]:
    import vescale.checkpoint.writing as writing

    run = _Run("tp2", seed=0)
    if dist.get_rank() == 0:  # what crashed saves left, to this path and to another one
        for crashed in (f"{path}.tmp-0badc0de", f"{path}2.tmp-0badc0de"):
            os.makedirs(crashed)
            open(os.path.join(crashed, "data_00000.bin"), "wb").close()
    dist.barrier()
    real = writing.write_file

    def slow(*args):  # keeps the async save below in progress while the next save starts
        time.sleep(0.5)
        return real(*args)

    writing.write_file = slow
    try:
        vescale.save(path, run.state(), async_save=True)
        run.train(_batches()[:1])
        vescale.save(path, run.state())  # must not sweep away the async save's directory
    finally:
        writing.write_file = real
    expected = run.full_parameters()
    other = _Run("tp2", seed=1)
    vescale.load(path, other.state())
    failures = [n for n, p in other.full_parameters().items() if not torch.equal(p, expected[n])]
    left = sorted(os.listdir(os.path.dirname(path)))
    if left != ["ckpt", "ckpt2.tmp-0badc0de"]:
        failures.append(f"directories left: {left}")
    return failures


def test_next_save_removes_temporary_directories_of_crashed_saves(pool2, tmp_path):
    assert pool2.run(_case_stale_tmp, str(tmp_path / "ckpt")) == [[]] * 2


# ---- Hugging Face safetensors and torch.save state dicts --------------------------------------

def _case_export(layout: str, directory: str) -> None:
    run = _Run(layout, seed=0)
    run.train(_batches()[:2])
    vescale.checkpoint.export_hf(directory, run.model, max_shard_size="40KB", optimizer=run.opt)
    full = run.full_parameters()
    if dist.get_rank() == 0:
        torch.save(full, directory + ".params.pt")
    dist.barrier()


def _case_import(layout: str, directory: str, kind: str) -> list[str]:
    run = _Run(layout, seed=1)
    if kind == "hf":
        vescale.checkpoint.import_hf(directory, run.model, optimizer=run.opt)
    else:
        vescale.checkpoint.load_torch_state_dict(directory + ".params.pt", run.model, optimizer=run.opt)
    saved = torch.load(directory + ".params.pt")
    failures = [n for n, p in run.full_parameters().items() if not torch.equal(p, saved[n])]
    run.train(_batches()[2:3])  # ZeRO master weights follow the imported parameters
    after = run.full_parameters()
    failures += [f"{n} after a step" for n, p in after.items() if not torch.isfinite(p).all()]
    return failures


@pytest.mark.parametrize("src,dst", [("dp2_tp2", "tp2"), ("zero3_dp4", "zero3_dp2_tp2"), ("tp4", "zero2_dp4")])
def test_hugging_face_export_and_import(pool2, pool4, tmp_path, src, dst):
    from safetensors.torch import load_file

    pools = {2: pool2, 4: pool4}
    directory = str(tmp_path / "hf")
    pools[WORLD[LAYOUTS[src][0]]].run(_case_export, src, directory)
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(os.path.join(directory, f)) <= 40_000 + 4096 for f in files)
    exported = {k: v for f in files for k, v in load_file(os.path.join(directory, f)).items()}
    saved = torch.load(directory + ".params.pt")
    assert sorted(exported) == sorted(n for n in saved if n != "lm_head.weight")  # tied: saved once
    assert all(torch.equal(exported[n], saved[n]) for n in exported)
    assert pools[WORLD[LAYOUTS[dst][0]]].run(_case_import, dst, directory, "hf") == [[]] * WORLD[LAYOUTS[dst][0]]


def _case_ranks_see_different_checkpoints(path: str) -> tuple[str, list[str]]:
    """Rank 2 resolves the path to another checkpoint than the others (as a machine whose
    file system still shows a crashed save's .old would): every rank refuses to load."""
    import shutil
    import vescale.checkpoint.loading as loading

    run = _Run("dp2_tp2", seed=0)
    vescale.save(path, run.state())
    if dist.get_rank() == 0:
        shutil.copytree(path, path + ".elsewhere")
    run.train(_batches()[:1])
    vescale.save(path, run.state())  # another manifest at the same path
    target = _Run("dp2_tp2", seed=1)
    before = target.full_parameters()
    real = loading._resolve
    loading._resolve = (lambda p: p + ".elsewhere") if dist.get_rank() == 2 else real
    try:
        vescale.load(path, target.state())
        error = "no error"
    except ValueError as e:
        error = str(e)
    finally:
        loading._resolve = real
    return error, [n for n, p in target.full_parameters().items() if not torch.equal(p, before[n])]


def test_ranks_that_see_different_checkpoints_load_nothing(pool4, tmp_path):
    for error, changed in pool4.run(_case_ranks_see_different_checkpoints, str(tmp_path / "ckpt")):
        assert "the ranks read different checkpoints" in error and ".elsewhere" in error, error
        assert changed == [], changed


def _case_import_one_rank_short(directory: str) -> tuple[str, list[str]]:
    """load_torch_state_dict of a state_dict that lacks a key on rank 1 only (each rank
    passed its own dict): every rank raises, and no rank's model changes."""
    run = _Run("dp2_tp2", seed=1)
    before = run.full_parameters()
    state = torch.load(directory + ".params.pt")
    if dist.get_rank() == 1:
        del state["transformer.h.0.attn.c_attn.weight"]
    try:
        vescale.checkpoint.load_torch_state_dict(state, run.model, optimizer=run.opt)
        error = "no error"
    except ValueError as e:
        error = str(e)
    return error, [n for n, p in run.full_parameters().items() if not torch.equal(p, before[n])]


def test_a_state_dict_short_on_one_rank_fails_every_rank(pool4, tmp_path):
    directory = str(tmp_path / "hf")
    pool4.run(_case_export, "dp2_tp2", directory)
    for error, changed in pool4.run(_case_import_one_rank_short, directory):
        assert "missing in the state_dict: transformer.h.0.attn.c_attn.weight" in error and "rank 1" in error, error
        assert changed == [], changed


def _case_export_fails_on_one_rank(directory: str) -> str:
    import safetensors.torch

    run = _Run("dp2_tp2", seed=0)
    real = safetensors.torch.save_file

    def full_disk(*args, **kwargs):
        if dist.get_rank() == 1:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    safetensors.torch.save_file = full_disk
    try:
        vescale.checkpoint.export_hf(directory, run.model, max_shard_size="40KB")
        return "no error"
    except OSError as e:
        return str(e)
    finally:
        safetensors.torch.save_file = real


def test_an_export_failing_on_one_rank_fails_every_rank(pool4, tmp_path):
    """A writer's disk error was raised on that rank alone; the others waited for it in the
    next gather until the collective timeout."""
    for error in pool4.run(_case_export_fails_on_one_rank, str(tmp_path / "hf")):
        assert "disk full (simulated)" in error and "found by rank 1" in error, error


def _case_import_escaping(directory: str) -> str:
    """A Hugging Face index naming a file outside its directory (the bytes intact)."""
    run = _Run("tp2", seed=0)
    vescale.checkpoint.export_hf(directory, run.model, max_shard_size="40KB")
    if dist.get_rank() == 0:
        file = os.path.join(directory, "model.safetensors.index.json")
        index = json.load(open(file))
        first = sorted(set(index["weight_map"].values()))[0]
        escaping = f"../{os.path.basename(directory)}-{first}"
        os.rename(os.path.join(directory, first), os.path.join(directory, escaping))
        index["weight_map"] = {k: escaping if v == first else v for k, v in index["weight_map"].items()}
        json.dump(index, open(file, "w"))
    dist.barrier()
    try:
        vescale.checkpoint.import_hf(directory, _Run("tp2", seed=1).model)
    except CorruptCheckpoint as e:
        return str(e)
    return "no error"


def test_hugging_face_index_cannot_reach_outside_its_directory(pool2, tmp_path):
    answers = pool2.run(_case_import_escaping, str(tmp_path / "hf"))
    assert all("which is not a plain file name" in a for a in answers), answers


def test_single_device_state_dict_loads_into_a_sharded_model(pool4, tmp_path):
    torch.manual_seed(3)
    plain = GPT(GPTConfig(**CONFIG))
    path = str(tmp_path / "sd")
    torch.save(plain.state_dict(), path + ".params.pt")
    assert pool4.run(_case_import, "dp2_tp2_sp", path, "torch") == [[]] * 4


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
