"""DTensors under torch.inference_mode(), as evaluation and serving code runs models:
the same values as one device, and torch's rules for which results are inference
tensors (new results are; views of normal tensors are not, so autograd can still track
them). Views of DTensors failed in inference mode before ("Cannot set version_counter
for inference tensor"), and so did every op built from views (max_pool1d)."""

import torch
import torch.nn.functional as F

from dist_utils import make_dtensor, mesh, mismatch, rand
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM
from vescale import Replicate, Shard
from vescale.parallel import parallelize_module
from vescale.parallel.plans import gpt_plan, llama_plan


def _steps(x):
    """A chain of views, in-place writes and ops built from views; every value it holds."""
    out = {"transpose": x.transpose(0, 1), "narrow": x.narrow(2, 1, 5), "unbind": x.unbind(1)[1]}
    out["view_of_view"] = out["transpose"].reshape(-1, x.shape[2])
    out["max_pool1d"] = F.max_pool1d(x, 2)
    out["softmax"] = out["narrow"].softmax(-1)
    out["written"] = x.mul_(2)  # in place into a normal tensor: allowed, its views see it
    out["transpose_after_write"] = out["transpose"] + 0
    return out


def _case_chain():
    failures = {}
    a = rand((3, 5, 9), seed=1)
    for name, placements in (("1d4", [Shard(1)]), ("2d", [Shard(2), Shard(0)]), ("2d", [Replicate(), Shard(1)])):
        x = make_dtensor(a, mesh(name), placements)
        ref = a.clone()
        with torch.inference_mode():
            got, want = _steps(x), _steps(ref)
        for key, w in want.items():
            g = got[key]
            if g.is_inference() != w.is_inference():
                failures[f"{name} {placements} {key}: is_inference"] = (g.is_inference(), w.is_inference())
            if (bad := mismatch(g.full_tensor(), w)) is not None:
                failures[f"{name} {placements} {key}"] = bad
    return failures


def test_views_and_writes_in_inference_mode(pool4):
    for failures in pool4.run(_case_chain):
        assert failures == {}


def _case_models():
    failures = {}
    for name, factory, plan in (("gpt", lambda: GPT(GPTConfig(bias=False)), gpt_plan()),
                                ("llama", lambda: LlamaForCausalLM(LlamaConfig()), llama_plan())):
        torch.manual_seed(0)
        ref = factory().eval()
        torch.manual_seed(0)
        model = factory().eval()
        parallelize_module(model, mesh("1d4"), plan)
        idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            want, got = ref(idx), model(idx)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if (bad := mismatch(got, want, rtol=1e-5, atol=1e-5)) is not None:
            failures[name] = bad
    return failures


def test_tensor_parallel_models_in_inference_mode(pool4):
    """The project's GPT and Llama, tensor parallel over 4 ranks, evaluated in inference
    mode: the single-device logits (float32, within 1e-5)."""
    for failures in pool4.run(_case_models):
        assert failures == {}


def _case_pipeline() -> list[str]:
    import vescale
    from torch.utils.data import TensorDataset
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 17))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    data = TensorDataset(inputs, targets)
    plan = vescale.Plan({"mesh": {"PP": 2, "DP": 2}, "pipeline_parallel.microbatches": 2,
                         "data.global_batch_size": 8, "data.shuffle": False})

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=64, n_layer=4, dropout=0.0, bias=False))

    model, _, _, loader = vescale.parallelize(plan, gpt(), None, None, data)
    x, y = next(iter(loader))
    model.eval()
    with torch.inference_mode():
        x, y = x.clone(), y.clone()  # inference tensors, as serving code makes them
        loss = float(model((x, y)))
        logits = model.predict(x)
    one = gpt().eval()
    with torch.inference_mode():
        ref_loss, ref_logits = float(one(inputs, targets)), one(inputs)
    rank = torch.distributed.get_rank() % 2  # this DP rank's half of the batch
    failures = []
    if (err := mismatch(torch.tensor(loss), torch.tensor(ref_loss), rtol=1e-6, atol=1e-7)) is not None:
        failures.append(f"loss: {err}")
    if (err := mismatch(logits, ref_logits[rank * 4:(rank + 1) * 4], rtol=1e-5, atol=1e-6)) is not None:
        failures.append(f"predict: {err}")
    return failures


def test_a_pipeline_evaluates_in_inference_mode(pool4):
    """What crosses a pipeline cut is told by requires_grad, and under torch.inference_mode
    the pipeline's enable_grad did nothing: the second stage computed on its stand-in
    zeros, a loss of ln(vocab), silently. The pipeline's forwards now leave inference mode."""
    for failures in pool4.run(_case_pipeline):
        assert failures == [], failures
