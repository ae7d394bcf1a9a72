"""vescale.parallelize: the veScale RFC loop, unchanged, under DP4, DP2xTP2+SP with ZeRO-2,
TP4 and PP2xTP2 on 4 ranks, with the project's GPT and a Hugging Face Llama whose plan
comes from its config; losses equal single device. Checkpoints carry the plan and resume
under another one; accumulation, clipping, parameter groups, recomputation and the
errors for plans that do not fit."""

import functools
import os

import pytest
import torch
from torch.utils.data import TensorDataset

import vescale
from vescale import Plan, PlanError
from vescale.data import DataLoader
from vescale.parallel.plans import gpt_plan

from dist_utils import mismatch
from examples.models.gpt import GPT, GPTConfig

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 64, 16, 8, 4, 1e-2


def _dataset(n: int = GLOBAL_BATCH * STEPS) -> TensorDataset:
    d = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(d[:, :-1].contiguous(), d[:, 1:].contiguous())


def _gpt(cfg: dict | None = None):
    torch.manual_seed(0)
    return GPT(GPTConfig(dropout=0.0, bias=False, **(cfg or {})))


def _llama():
    import transformers as tf
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _nanogpt_groups(model):
    """nanoGPT's configure_optimizers: decay for matrices, none for vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)


def _single_device(make_model, optimizer_fn, batches, *, clip=None, call=None):
    model = make_model()
    opt = optimizer_fn(model)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = call(model, x, y) if call else model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _rfc_loop(model, optimizer, data_loader, steps: int, call=None) -> list[float]:
    losses = []
    for _, batch in zip(range(steps), data_loader):  # (range first: no batch is drawn and dropped)
        optimizer.zero_grad()
        loss = model(batch) if call is None else call(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item())
    return losses


PLANS = {
    "dp4": {"mesh": {"DP": 4}},
    "dp2-tp2-sp-zero2": {"mesh": {"DP": 2, "TP": 2}, "tensor_parallel.sharding_plan": gpt_plan(sequence_parallel=True),
                         "tensor_parallel.sequence_parallel": True, "data_parallel.zero_stage": 2},
    "tp4": {"mesh": {"TP": 4}, "tensor_parallel.sharding_plan": gpt_plan()},
    "pp2-tp2": {"mesh": {"PP": 2, "TP": 2}, "tensor_parallel.sharding_plan": gpt_plan(),
                "pipeline_parallel.microbatches": 2},
}


def _case_gpt(name: str) -> tuple[list[float], list[float]]:
    plan = Plan(PLANS[name])
    plan.update({"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 4}), _adamw, None, _dataset())
    losses = _rfc_loop(model, optimizer, loader, STEPS)
    data = _dataset()
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    return losses, _single_device(lambda: _gpt({"n_layer": 4}), _adamw, batches)


@pytest.mark.parametrize("name", list(PLANS))
def test_rfc_loop_matches_single_device(pool4, name):
    for losses, ref in pool4.run(_case_gpt, name):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _case_last_batch_smaller(name: str, epochs: int) -> tuple[list[float], list[float]]:
    """Two epochs of a dataset whose last global batch (3 samples of 8) splits unevenly
    over the DP ranks: 1, 1, 1 and 0 rows on DP4 (a rank without samples), 2 and 1 on DP2."""
    n = GLOBAL_BATCH * 2 + 3
    plan = Plan(PLANS[name])
    plan.update({"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, "data.drop_last": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 2}), _sgd, None, _dataset(n))
    losses = [loss for _ in range(epochs) for loss in _rfc_loop(model, optimizer, loader, 3)]
    data = _dataset(n)
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, n, GLOBAL_BATCH)] * epochs
    return losses, _single_device(lambda: _gpt({"n_layer": 2}), _sgd, batches)


@pytest.mark.parametrize("name", ["dp4", "dp2-tp2-sp-zero2"])
def test_a_last_batch_split_unevenly_trains_as_on_one_device(pool4, name):
    """With drop_last=False the epoch's last, smaller batch gives the DP ranks different
    numbers of rows, or none: the global loss and the gradient weigh each rank by its rows,
    as one device's mean over the batch does (they used to average the ranks' means: the
    loss NaN where a rank had no rows, the gradient off by the ranks' share). SGD, so the
    next epoch's losses show the gradient of the uneven step."""
    for losses, ref in pool4.run(_case_last_batch_smaller, name, 2):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _case_pipeline_uneven() -> list[str]:
    plan = Plan({"mesh": {"PP": 2, "DP": 2}, "pipeline_parallel.microbatches": 2})
    plan.update({"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, "data.drop_last": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 2}), _sgd, None,
                                                      _dataset(GLOBAL_BATCH + 3))
    errors = []
    for batch in loader:  # 4 rows per DP rank, then 2 and 1
        optimizer.zero_grad()
        try:
            model(batch)
        except ValueError as e:
            errors.append(str(e))
        optimizer.step()
    return errors


def test_a_pipeline_refuses_uneven_batches_on_every_rank(pool4):
    """Under a pipeline the uneven last batch is refused on every rank alike: the rank with
    fewer rows than micro-batches used to raise alone while the others waited."""
    for errors in pool4.run(_case_pipeline_uneven):
        assert len(errors) == 1 and "must be even" in errors[0] and "1 to 2 rows" in errors[0], errors


def _with_l2(model, *args):
    """The model's loss plus a term computed outside it (an L2 penalty on the parameters)."""
    loss = model(*args)
    l2 = sum((p.full_tensor() if isinstance(p, vescale.DTensor) else p).pow(2).sum() for p in model.parameters())
    return loss + 1e-3 * l2


def _case_term_outside_the_model(name: str) -> tuple[list[float], list[float]]:
    plan = Plan(PLANS[name])
    plan.update({"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 2}), _sgd, None, _dataset())
    losses = _rfc_loop(model, optimizer, loader, STEPS, call=_with_l2)
    data = _dataset()
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    return losses, _single_device(lambda: _gpt({"n_layer": 2}), _sgd, batches, call=_with_l2)


@pytest.mark.parametrize("name", ["dp4", "dp2-tp2-sp-zero2"])
def test_a_loss_term_outside_the_model_is_averaged_like_the_rest(pool4, name):
    """A term added to the returned loss (its gradient the same on every DP rank) trains as
    on one device: DDP averages it with the model's gradients (SGD, so that the penalty's
    gradient moves the losses at once)."""
    for losses, ref in pool4.run(_case_term_outside_the_model, name):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _case_parallelize_again_and_again() -> tuple[list[int], bool, bool]:
    """Threads of this rank after each of six parallelize calls (two meshes, in turn),
    and whether the same mesh comes back for the same shape and names."""
    threads = []
    for i in range(6):
        plan = Plan(PLANS["dp2-tp2-sp-zero2" if i % 2 else "pp2-tp2"])
        plan.update({"data.global_batch_size": GLOBAL_BATCH})
        vescale.parallelize(plan, _gpt({"n_layer": 2}), _adamw, None, _dataset())
        threads.append(len(os.listdir("/proc/self/task")))
    a = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    same = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP")) is a
    other = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "TP")) is not a
    return threads, same, other


def test_parallelize_again_and_again_keeps_its_process_groups(pool4):
    """Each parallelize used to make its mesh's process groups anew, which torch never
    frees (gloo: threads and sockets): a sweep or the planner's trials gathered them."""
    for threads, same, other in pool4.run(_case_parallelize_again_and_again):
        assert same and other
        assert threads[2:] == [threads[1]] * 4, threads  # both meshes made once: no thread more after


# ---- a Hugging Face model, its plan from its config ----------------------------------------------

class _Tokens(torch.utils.data.Dataset):
    """Hugging Face style samples: dicts of input_ids and labels."""

    def __init__(self, n: int = GLOBAL_BATCH * STEPS):
        self.ids = _dataset(n).tensors[0]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_loss(model, batch):
    out = model(batch)
    return out if isinstance(out, torch.Tensor) else out.loss  # under a pipeline: the loss itself


def _case_hf(mesh: dict, extra: dict) -> tuple[list[float], list[float], str]:
    model = _llama()
    plan = Plan.from_hf(model, mesh=mesh, **{"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, model, _adamw, None, _Tokens())
    losses = _rfc_loop(model, optimizer, loader, STEPS, call=_hf_loss)
    ids = _Tokens().ids
    batches = [(ids[i:i + GLOBAL_BATCH], None) for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    ref = _single_device(_llama, _adamw, batches, call=lambda m, x, _: m(input_ids=x, labels=x).loss)
    return losses, ref, repr(plan)


@pytest.mark.parametrize("mesh,extra", [({"DP": 2, "TP": 2}, {"data_parallel.zero_stage": 1}),
                                        ({"PP": 2, "TP": 2}, {"pipeline_parallel.microbatches": 2}),
                                        ({"DP": 4}, {"data_parallel.zero_stage": 3})],
                         ids=["dp2-tp2-zero1", "pp2-tp2", "dp4-zero3"])
def test_hugging_face_plan_from_its_config(pool4, mesh, extra):
    # dp4-zero3: the root's parameters (embeddings, head) are gathered again for backward
    # although the model returns a ModelOutput (a module backward hook never fired on it)
    for losses, ref, text in pool4.run(_case_hf, mesh, extra):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)
        assert "pipeline_parallel.blocks : \"model.layers\"" in text
        if "TP" in mesh:
            assert 'model\\.layers\\.\\d+\\.self_attn\\.q_proj\\.weight -> ["Shard(0)"]' in text


# ---- checkpoints carry the plan; resume under another ---------------------------------------------

def _case_resume(path: str, first: str, second: str) -> tuple[list[float], list[float]]:
    half = STEPS // 2

    def setup(name):
        plan = Plan(PLANS[name])
        plan.update({"data.global_batch_size": GLOBAL_BATCH, "data.shuffle": True, "data.seed": 5})
        return plan, *vescale.parallelize(plan, _gpt({"n_layer": 4}), _adamw, None, _dataset())

    plan, model, optimizer, _, loader = setup(first)
    losses = _rfc_loop(model, optimizer, loader, half)
    vescale.save(path, {"plan": plan, "model": model, "optimizer": optimizer, "data": loader})
    plan2, model2, optimizer2, _, loader2 = setup(second)
    saved_plan = Plan()
    vescale.load(path, {"plan": saved_plan, "model": model2, "optimizer": optimizer2, "data": loader2})
    assert saved_plan == plan
    losses += _rfc_loop(model2, optimizer2, loader2, half)
    # the same shuffled order on one device: the loader's global batches
    order = DataLoader(_dataset(), None, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=5)
    batches = [tuple(b) for _, b in zip(range(STEPS), order)]
    return losses, _single_device(lambda: _gpt({"n_layer": 4}), _adamw, batches)


@pytest.mark.parametrize("first,second", [("dp2-tp2-sp-zero2", "tp4"), ("tp4", "pp2-tp2")])
def test_resume_under_another_plan(pool4, tmp_path, first, second):
    for losses, ref in pool4.run(_case_resume, str(tmp_path / "ckpt"), first, second):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


# ---- accumulation, clipping, parameter groups, recomputation, loss scaling --------------------------

def _case_options(extra: dict, optimizer_fn, clip) -> tuple[list[float], list[float]]:
    k = extra.get("gradient.accumulation_steps", 1)
    plan = Plan({"mesh": {"DP": 2, "TP": 2}, "tensor_parallel.sharding_plan": gpt_plan(),
                 "data.global_batch_size": GLOBAL_BATCH // k, "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt(), optimizer_fn, None, _dataset())
    micro = _rfc_loop(model, optimizer, loader, STEPS * k)
    losses = [sum(micro[i:i + k]) / k for i in range(0, len(micro), k)]  # the mean over each window
    data = _dataset()
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH)]
    if isinstance(optimizer_fn, functools.partial):  # an optimizer class: it takes the parameters
        ref_fn = lambda m: optimizer_fn(m.parameters())  # noqa: E731
    else:
        ref_fn = optimizer_fn
    return losses, _single_device(_gpt, ref_fn, batches, clip=clip)


OPTIONS = {
    "accumulate2": ({"gradient.accumulation_steps": 2}, _adamw, None),
    "accumulate2-zero2": ({"gradient.accumulation_steps": 2, "data_parallel.zero_stage": 2}, _adamw, None),
    "clip": ({"gradient.clip_norm": 0.05}, _adamw, 0.05),
    "clip-zero1": ({"gradient.clip_norm": 0.05, "data_parallel.zero_stage": 1}, _adamw, 0.05),
    "groups-zero1": ({"data_parallel.zero_stage": 1}, _nanogpt_groups, None),
    "groups-sgd-class": ({}, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), None),
    "recompute": ({"recompute.modules": [r"transformer\.h\.\d+"]}, _adamw, None),
    "loss-scale": ({"data_parallel.zero_stage": 1, "mixed_precision.loss_scale": 1024.0}, _adamw, None),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_training_options_match_single_device(pool4, name):
    extra, optimizer_fn, clip = OPTIONS[name]
    for losses, ref in pool4.run(_case_options, extra, optimizer_fn, clip):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


# ---- plans that do not fit: clear errors, nothing half done --------------------------------------

def _case_errors() -> list[str]:
    problems = []

    def expect(match: str, plan: dict, dataset=None, model=None):
        import re
        try:
            vescale.parallelize(Plan(plan), model or _gpt(), _adamw, None, dataset)
            problems.append(f"{plan}: no error")
        except (PlanError, ValueError, TypeError) as e:
            if not re.search(match, str(e)):
                problems.append(f"{plan}: {e}")

    expect(r"holds 2 ranks but the world has 4", {"mesh": {"DP": 2}})
    expect(r"data_parallel.dim is 'DP', which is not a dim of the mesh", {"mesh": {"TP": 4},
                                                                              "data_parallel.zero_stage": 2})
    expect(r"param_dtype .*set data_parallel.zero_stage", {"mesh": {"DP": 4}, "mixed_precision.param_dtype": "bfloat16"})
    expect(r"accumulation_steps > 1 with a pipeline.*microbatches", {"mesh": {"PP": 4}, "gradient.accumulation_steps": 2})
    expect(r"no data.global_batch_size", {"mesh": {"DP": 4}}, dataset=_dataset())
    expect(r"recompute.modules .*matches no module", {"mesh": {"DP": 4}, "recompute.modules": [r"blocks\.\d+"]})
    expect(r"split_points names 'transformer.h.9'", {"mesh": {"PP": 2, "DP": 2},
                                                     "pipeline_parallel.split_points": ["transformer.h.9"]})
    expect(r"split_method is 'flops', which measures the model on a micro-batch: pass the dataset",
           {"mesh": {"PP": 4}, "pipeline_parallel.split_method": "flops"})
    expect(r"recompute.modules with the zero-bubble schedule 'zb_h1' is not supported.*use schedule '1f1b'",
           {"mesh": {"PP": 4}, "pipeline_parallel.schedule": "zb_h1", "recompute.modules": [r"transformer\.h\.\d+"]})
    # the process goes on: a good plan afterwards trains
    model, optimizer, _, _ = vescale.parallelize(Plan({"mesh": {"DP": 4}}), _gpt(), _adamw)
    x = torch.randint(0, VOCAB, (2, SEQ))
    optimizer.zero_grad()
    model((x, x)).backward()
    optimizer.step()
    return problems


def test_plans_that_do_not_fit_are_clear_errors(pool4):
    for problems in pool4.run(_case_errors):
        assert problems == []


def _case_eval() -> tuple[float, float]:
    model, _, _, _ = vescale.parallelize(Plan({"mesh": {"DP": 2, "TP": 2}, "tensor_parallel.sharding_plan": gpt_plan()}),
                                         _gpt())
    x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model((x, x))
    ref = _gpt()
    with torch.no_grad():
        return float(loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss), float(ref(x, x))


def test_evaluation_without_an_optimizer(pool4):
    """no_grad forward (no optimizer made): every DP rank evaluates the same batch here, so
    the global loss is the single-device one."""
    for loss, ref in pool4.run(_case_eval):
        assert abs(loss - ref) <= 1e-5 * abs(ref)


def _case_two_models() -> tuple[list[float], list[float], list[float], list[float]]:
    """An actor and a critic, each with its own plan, in one program."""
    data = _dataset()
    batches = [(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
               for i in range(0, GLOBAL_BATCH * 2, GLOBAL_BATCH)]
    actor, actor_opt, _, _ = vescale.parallelize(Plan({"mesh": {"TP": 4}, "tensor_parallel.sharding_plan": gpt_plan()}),
                                                 _gpt(), _adamw)
    critic, critic_opt, _, _ = vescale.parallelize(Plan({"mesh": {"DP": 2, "TP": 2},
                                                         "tensor_parallel.sharding_plan": gpt_plan(),
                                                         "data_parallel.zero_stage": 1}),
                                                   _gpt({"n_layer": 1}), _adamw)
    a_losses, c_losses = [], []
    dp_rank = torch.distributed.get_rank() // 2
    for x, y in batches:
        for model, opt, losses, part in ((actor, actor_opt, a_losses, slice(None)),
                                         (critic, critic_opt, c_losses, slice(dp_rank * 4, dp_rank * 4 + 4))):
            opt.zero_grad()
            loss = model((x[part], y[part]))
            loss.backward()
            opt.step()
            losses.append(loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item())
    return (a_losses, _single_device(_gpt, _adamw, batches), c_losses,
            _single_device(lambda: _gpt({"n_layer": 1}), _adamw, batches))


def test_two_models_with_their_own_plans(pool4):
    for a, a_ref, c, c_ref in pool4.run(_case_two_models):
        assert mismatch(torch.tensor(a), torch.tensor(a_ref), rtol=1e-5, atol=1e-6) is None, (a, a_ref)
        assert mismatch(torch.tensor(c), torch.tensor(c_ref), rtol=1e-5, atol=1e-6) is None, (c, c_ref)


def _case_low_precision(dtype_name: str, loss_scale, mesh: dict, extra: dict) -> tuple:
    plan = Plan({"mesh": mesh, "data_parallel.zero_stage": 1, "mixed_precision.param_dtype": dtype_name,
                 "mixed_precision.loss_scale": loss_scale,
                 "data.global_batch_size": GLOBAL_BATCH, "data.shuffle": False, **extra})
    model, optimizer, _, loader = vescale.parallelize(plan, _gpt({"n_layer": 4}), _sgd, None, _dataset())
    dtype = str(next(model.parameters()).dtype)
    losses = _rfc_loop(model, optimizer, loader, STEPS)
    # one device, the same recipe: a low-precision model, fp32 master weights in SGD, and
    # vescale's loss scaling (the loss's gradient is the scale, in the loss's dtype; an
    # inf or NaN skips the step and, when dynamic, halves the scale)
    ref = _gpt({"n_layer": 4}).to(getattr(torch, dtype_name))
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1)  # (not Adam: a gradient's scale shows)
    scale = None if loss_scale is None else 2.0**16 if loss_scale == "dynamic" else float(loss_scale)
    data = _dataset()
    ref_losses = []
    for i in range(0, GLOBAL_BATCH * STEPS, GLOBAL_BATCH):
        for p in ref.parameters():
            p.grad = None
        loss = ref(data.tensors[0][i:i + GLOBAL_BATCH], data.tensors[1][i:i + GLOBAL_BATCH])
        loss.backward(None if scale is None else torch.ones_like(loss) * scale)
        ref_losses.append(loss.item())
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float() / (scale or 1.0)
        if not all(torch.isfinite(m.grad).all() for m in masters):
            scale /= 2.0 if loss_scale == "dynamic" else 1.0
            continue
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
    scaler = optimizer.inner.scaler
    # the gradients of one more batch, unscaled, where ZeRO-1 leaves them whole
    grads = {}
    if plan["data_parallel.zero_stage"] == 1:
        optimizer.zero_grad()
        model(next(iter(loader))).backward()
        ref.zero_grad()
        ref(data.tensors[0][:GLOBAL_BATCH], data.tensors[1][:GLOBAL_BATCH]).backward(
            None if scale is None else torch.ones_like(loss) * scale)
        ref_grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, vescale.DTensor) else p.grad
                want = next(r.grad for n, r in ref_grads.items() if name.endswith(n))
                divisor = scaler.scale if scaler is not None else 1.0
                grads[name] = mismatch(g.float() / divisor, want.float() / (scale or 1.0),
                                       rtol=2e-2, atol=2e-2 * float(want.float().abs().max() / (scale or 1.0)))
    return losses, ref_losses, dtype, None if scaler is None else scaler.scale, scale, grads


@pytest.mark.parametrize("dtype_name,loss_scale,mesh,extra", [
    ("bfloat16", None, {"DP": 2, "TP": 2}, {"tensor_parallel.sharding_plan": gpt_plan()}),
    ("float16", 128.0, {"DP": 2, "TP": 2}, {"tensor_parallel.sharding_plan": gpt_plan()}),
    ("float16", "dynamic", {"DP": 2, "TP": 2}, {"tensor_parallel.sharding_plan": gpt_plan()}),
    ("float16", "dynamic", {"PP": 2, "DP": 2}, {"pipeline_parallel.microbatches": 2}),
    ("float16", 128.0, {"PP": 2, "DP": 2}, {"pipeline_parallel.schedule": "zbv", "pipeline_parallel.virtual_stages": 2,
                                             "pipeline_parallel.microbatches": 2, "data_parallel.zero_stage": 3}),
    ("float16", "dynamic", {"PP": 4, "DP": 1}, {"pipeline_parallel.schedule": "gpipe",
                                                 "pipeline_parallel.microbatches": 4}),
], ids=["bf16-dp2-tp2", "fp16-128-dp2-tp2", "fp16-dynamic-dp2-tp2", "fp16-dynamic-pp2-dp2-1f1b",
        "fp16-128-pp2-dp2-zbv-zero3", "fp16-dynamic-pp4-gpipe"])
def test_low_precision_parameters_with_fp32_masters(pool4, dtype_name, loss_scale, mesh, extra):
    """The parameters are bf16 / fp16 and the optimizer steps fp32 masters. fp16 scales the
    loss: 128 (a power of two that neither overflows nor underflows here, so exact), or
    dynamic, whose first scale, 2^16, is inf in fp16 on one device too: that step is skipped
    on both sides and the scale halved. Under a pipeline each micro-batch's loss is scaled
    and its gradient is this rank's share. Low precision sums in another order on 4 ranks
    than on one, so the losses agree to its precision only; the final scales are equal (the
    same steps were skipped)."""
    for losses, ref, dtype, scale, ref_scale, grads in pool4.run(_case_low_precision, dtype_name, loss_scale, mesh,
                                                                  extra):
        assert dtype == f"torch.{dtype_name}"
        assert scale == ref_scale, (scale, ref_scale)
        assert extra.get("data_parallel.zero_stage") == 3 or grads, "no gradient was compared"
        assert all(m is None for m in grads.values()), {n: m for n, m in grads.items() if m is not None}
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-2, atol=0) is None, (losses, ref)


def _case_export(path: str, name: str) -> list[str]:
    """The torch-style checkpoint: one file, gathered, that a single-device model loads."""
    plan = Plan(PLANS[name])
    model, optimizer, _, _ = vescale.parallelize(plan, _gpt({"n_layer": 4}), _adamw)
    x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))
    optimizer.zero_grad()
    model((x, x)).backward()
    optimizer.step()
    vescale.checkpoint.export_torch(path, model, optimizer=optimizer.inner if plan["data_parallel.zero_stage"] else None)
    single = _gpt({"n_layer": 4})
    missing, unexpected = single.load_state_dict(torch.load(path, weights_only=True), strict=False)
    problems = [f"unexpected {unexpected}"] if unexpected else []
    problems += [f"missing {k}" for k in missing if k != "lm_head.weight"]  # tied with the embedding
    ref = _gpt({"n_layer": 4})  # the same step on one device
    ref_opt = _adamw(ref)
    ref(x, x).backward()
    ref_opt.step()
    with torch.no_grad():
        loaded, want = float(single(x, x)), float(ref(x, x))
    if abs(loaded - want) > 1e-5 * abs(want):
        problems.append(f"loss of the exported weights {loaded} != single-device training's {want}")
    return problems


@pytest.mark.parametrize("name", ["dp2-tp2-sp-zero2", "pp2-tp2"])
def test_torch_style_export_loads_on_one_device(pool4, tmp_path, name):
    for problems in pool4.run(_case_export, str(tmp_path / "model.pt"), name):
        assert problems == []


def _case_sync_flag() -> tuple[bool, bool]:
    """torch DDP's require_backward_grad_sync: False accumulates without reducing."""
    from vescale.parallel import DDP
    mesh = vescale.init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1, bias=False), mesh["DP"])
    x = torch.full((1, 4), float(torch.distributed.get_rank() + 1))
    model.require_backward_grad_sync = False
    model(x).sum().backward()
    local = model.module.weight.grad.clone()  # this rank's own gradient: x
    model.require_backward_grad_sync = True
    model(x).sum().backward()  # reduces the accumulated 2x over the ranks
    reduced = model.module.weight.grad
    return torch.equal(local, x[0].unsqueeze(0)), torch.allclose(reduced, torch.full((1, 4), 2 * 2.5))


def test_ddp_require_backward_grad_sync(pool4):
    for unreduced, reduced in pool4.run(_case_sync_flag):
        assert unreduced and reduced
