"""Hugging Face safetensors and torch.save state dicts: export from one layout and import
into another bitwise; a failure on one rank (a missing key, a full disk) fails every rank;
an index cannot reach outside its directory."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.checkpoint import CorruptCheckpoint

from test_parallel import LAYOUTS
from examples.models.gpt import GPT, GPTConfig
from checkpoint_runs import CONFIG, WORLD, _batches, _Run


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
