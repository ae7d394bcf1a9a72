"""vescale.save / vescale.load when something goes wrong: a crash mid-save, the
temporary directories of crashed saves, a manifest that does not fit the target, ranks
that see different checkpoints, and checkpoints that cannot be trusted: damaged or
truncated files (every rank raises the same error and none changes anything), pickles
planted in them (never run), and file names that lead outside the checkpoint."""

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
from vescale.parallel import DDP
from vescale.parallel.ddp import local_of

from examples.models.gpt import GPT, GPTConfig
from checkpoint_runs import CONFIG, _batches, _Run


# ---- crashes mid-save -------------------------------------------------------------------------

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


# ---- ranks that see the file system differently -----------------------------------------------

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
