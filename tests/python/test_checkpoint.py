"""vescale.save / vescale.load: a checkpoint saved on one mesh, world size and ZeRO stage
loads into another with every parameter bitwise equal to the saved global tensor, and
training resumed from it gives the losses of an uninterrupted single-device run on
the same global batches (fp32, rtol 1e-5). Also: async save, crash mid-save,
corrupted and truncated files, and a manifest that does not fit the target."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.checkpoint import CorruptCheckpoint
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module

from dist_utils import mesh, mismatch
from test_parallel import LAYOUTS
from tests.models.gpt import GPT, GPTConfig
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


def _case_crash_mid_save(path: str) -> list[str]:
    import vescale.checkpoint.api as api

    run = _Run("dp2_tp2", seed=0)
    run.train(_batches()[:1])
    vescale.save(path, run.state())
    good = run.full_parameters()
    run.train(_batches()[1:2])
    real = api.write_file

    def dies_halfway(file, chunks):
        real(file, chunks[: len(chunks) // 2])
        raise OSError("disk full (simulated)")

    api.write_file = dies_halfway
    try:
        vescale.save(path, run.state())
        return ["the failing save did not raise"]
    except OSError:
        pass
    finally:
        api.write_file = real
    other = _Run("tp4", seed=1)
    vescale.load(path, other.state())
    return [n for n, p in other.full_parameters().items() if not torch.equal(p, good[n])]


def test_crash_mid_save_keeps_the_previous_checkpoint(pool4, tmp_path):
    assert pool4.run(_case_crash_mid_save, str(tmp_path / "ckpt")) == [[]] * 4


def _damage(path: str, how: str) -> None:
    data = sorted(f for f in os.listdir(path) if f.startswith("data_"))
    target = os.path.join(path, max(data, key=lambda f: os.path.getsize(os.path.join(path, f))))
    if how == "truncate":
        os.truncate(target, os.path.getsize(target) // 2)
    else:
        with open(target, "r+b") as f:
            f.seek(os.path.getsize(target) // 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


def _case_damaged(path: str, how: str) -> str:
    run = _Run("dp2_tp2", seed=0)
    vescale.save(path, run.state())
    if dist.get_rank() == 0:
        _damage(path, how)
    dist.barrier()
    target = _Run("tp4", seed=1)
    try:
        vescale.load(path, target.state())
    except CorruptCheckpoint as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_files_are_detected(pool4, tmp_path, how):
    answers = pool4.run(_case_damaged, str(tmp_path / "ckpt"), how)
    expected = "truncated" if how == "truncate" else "checksum mismatch"
    # every rank whose boxes touch the damage says so; a flip may spare some ranks' bytes
    assert all(expected in a or a == "no error" for a in answers), answers
    assert any(expected in a for a in answers), answers


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


def test_single_device_state_dict_loads_into_a_sharded_model(pool4, tmp_path):
    torch.manual_seed(3)
    plain = GPT(GPTConfig(**CONFIG))
    path = str(tmp_path / "sd")
    torch.save(plain.state_dict(), path + ".params.pt")
    assert pool4.run(_case_import, "dp2_tp2_sp", path, "torch") == [[]] * 4
