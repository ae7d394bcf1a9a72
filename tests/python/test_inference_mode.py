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
