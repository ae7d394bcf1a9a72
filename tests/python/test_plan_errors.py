"""parallelize_module's errors for malformed plans: every form of a bad entry raises a
TypeError or ValueError that quotes the key, says what was expected and shows the right
form; the module is left as it was, and a correct call afterwards works."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.tensor as torch_dtensor

import vescale
from vescale import Partial, Replicate, Shard
from vescale.parallel import parallelize_module
from vescale.parallel.plans import bert_plan, gpt2_plan, gpt_plan, hf_plan, llama_plan, t5_plan

from dist_utils import mesh, mismatch
from examples.models.gpt import GPT, GPTConfig

MLP_OUT = r"transformer\.h\.\d+\.mlp\.output"
HEAD = r"lm_head\.weight"
# The right forms, as the messages write them (the keys' repr: backslashes doubled).
MLP_OUT_EXAMPLE = r"{'transformer\\.h\\.\\d+\\.mlp\\.output': [[Replicate()]]}"
HEAD_EXAMPLE = r"{'lm_head\\.weight': [Shard(0)]}"
PLAN_EXAMPLE = r"{'parameter': {'mlp\\.fc1\\.weight': [Shard(0)]}, 'forward': {'mlp\\.fc1\\.output': [[Replicate()]]}}"

# name -> (plan, error class, what the message must say besides the key and the example,
#          the key as quoted, the example of the right form)
CASES = {
    # forward entries
    "forward flat list (the issue)": ({"forward": {MLP_OUT: [Replicate()]}}, TypeError,
                                      "flat list of placements.*two brackets", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward bare placement": ({"forward": {MLP_OUT: Replicate()}}, TypeError,
                               "a single placement instead of a list", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward one bracket too many": ({"forward": {MLP_OUT: [[[Replicate()]]]}}, TypeError,
                                     "output 0, gives .*one bracket too many", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward strings": ({"forward": {MLP_OUT: [["Replicate()"]]}}, TypeError,
                        "'Replicate\\(\\)' is a string, not a placement", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward not a placement": ({"forward": {MLP_OUT: [[0]]}}, TypeError,
                                "0 \\(of type int\\) is not a placement", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward placement class": ({"forward": {MLP_OUT: [[Replicate]]}}, TypeError,
                                "Replicate is the class, not a placement: write Replicate\\(\\)", MLP_OUT,
                                MLP_OUT_EXAMPLE),
    "forward torch's placement": ({"forward": {MLP_OUT: [[torch_dtensor.Replicate()]]}}, TypeError,
                                  "torch.distributed.tensor's Replicate, not vescale's", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward placements per mesh dim": ({"forward": {MLP_OUT: [[Replicate(), Replicate()]]}}, ValueError,
                                        "2 placements for a 1-dim mesh", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward dict for outputs": ({"forward": {MLP_OUT: {"x": [Replicate()]}}}, TypeError,
                                 "outputs are positional", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward keyword argument": ({"forward": {r"transformer\.ln_f\.input": {"input": Replicate()}}}, TypeError,
                                 "keyword argument 'input', gives Replicate\\(\\), a single placement",
                                 r"transformer\.ln_f\.input", r"{'transformer\\.ln_f\\.input': [[Replicate()]]}"),
    "forward empty list": ({"forward": {MLP_OUT: []}}, ValueError, "an empty list, which moves nothing",
                           MLP_OUT, MLP_OUT_EXAMPLE),
    "forward None": ({"forward": {MLP_OUT: None}}, TypeError, "gives None", MLP_OUT, MLP_OUT_EXAMPLE),
    "forward misspelt suffix": ({"forward": {r"transformer\.h\.\d+\.mlp\.out": [[Replicate()]]}}, ValueError,
                                "must end in '.input' or '.output'", r"transformer\.h\.\d+\.mlp\.out",
                                MLP_OUT_EXAMPLE),
    "forward no suffix": ({"forward": {r"transformer\.ln_f": [[Replicate()]]}}, ValueError,
                          "must end in '.input' or '.output'", r"transformer\.ln_f",
                          r"{'transformer\\.ln_f\\.output': [[Replicate()]]}"),
    "forward matches nothing": ({"forward": {r"mlp\.output": [[Replicate()]]}}, ValueError,
                                "pattern 'mlp' matches no submodule; module names look like \\['transformer'",
                                r"mlp\.output", r"{'transformer\\.output': [[Replicate()]]}"),
    "forward bad regex": ({"forward": {r"(mlp\.output": [[Replicate()]]}}, ValueError,
                          "not a valid regular expression", r"(mlp\.output",
                          r"{'mlp\\.fc1\\.output': [[Replicate()]]}"),
    # parameter entries
    "parameter bare placement": ({"parameter": {HEAD: Shard(0)}}, TypeError,
                                 "a single placement instead of a list", HEAD, HEAD_EXAMPLE),
    "parameter list of lists": ({"parameter": {HEAD: [[Shard(0)]]}}, TypeError,
                                "a list of lists.*nested form \\[\\[...\\]\\] is for 'forward' keys", HEAD,
                                HEAD_EXAMPLE),
    "parameter strings": ({"parameter": {HEAD: ["Shard(0)"]}}, TypeError, "'Shard\\(0\\)' is a string", HEAD,
                          HEAD_EXAMPLE),
    "parameter one string": ({"parameter": {HEAD: "Shard(0)"}}, TypeError, "the string 'Shard\\(0\\)'", HEAD,
                             HEAD_EXAMPLE),
    "parameter not a placement": ({"parameter": {HEAD: [0]}}, TypeError, "is not a placement", HEAD,
                                  HEAD_EXAMPLE),
    "parameter placement class": ({"parameter": {HEAD: [Shard]}}, TypeError,
                                  "Shard is the class, not a placement: write Shard\\(0\\)", HEAD, HEAD_EXAMPLE),
    "parameter torch's placement": ({"parameter": {HEAD: [torch_dtensor.Shard(0)]}}, TypeError,
                                    "not vescale's: use vescale.Shard", HEAD, HEAD_EXAMPLE),
    "parameter dict": ({"parameter": {HEAD: {"TP": Shard(0)}}}, TypeError, "a dict", HEAD, HEAD_EXAMPLE),
    "parameter placements per mesh dim": ({"parameter": {HEAD: [Shard(0), Replicate()]}}, ValueError,
                                          "2 placements for a 1-dim mesh", HEAD, HEAD_EXAMPLE),
    "parameter shard dim out of range": ({"parameter": {HEAD: [Shard(2)]}}, ValueError,
                                         "out of range for its 2 dims", HEAD, "Shard(d) with d in range(-2, 2)"),
    "parameter matches nothing": ({"parameter": {r"lm_head\.bias": [Shard(0)]}}, ValueError,
                                  "match no parameter of GPT.*'transformer.wte.weight'", r"lm_head\.bias",
                                  r"{'transformer\\.wte\\.weight': [Shard(0)]}"),
    "forward key in the parameter section": ({"parameter": {r"lm_head\.output": [Shard(0)]}}, ValueError,
                                             "look like forward keys", r"lm_head\.output",
                                             r"{'transformer\\.wte\\.weight': [Shard(0)]}"),
    "parameter bad regex": ({"parameter": {r"lm_head\.(weight": [Shard(0)]}}, ValueError,
                            "not a valid regular expression", r"lm_head\.(weight",
                            r"{'mlp\\.fc1\\.weight': [Shard(0)]}"),
    "parameter key not a string": ({"parameter": {3: [Shard(0)]}}, TypeError, "of type int, not a string", 3,
                                   r"{'mlp\\.fc1\\.weight': [Shard(0)]}"),
    # the plan itself
    "plan not a dict": ([(HEAD, [Shard(0)])], TypeError, "must be a dict", None, PLAN_EXAMPLE),
    "plan helper not called": (gpt_plan, TypeError, "call it: gpt_plan\\(...\\)", None, PLAN_EXAMPLE),
    "unknown section": ({"parameters": {HEAD: [Shard(0)]}}, ValueError, "did you mean 'parameter'", "parameters",
                        PLAN_EXAMPLE),
    "section not a dict": ({"parameter": [(HEAD, [Shard(0)])]}, TypeError, "must be a dict from pattern",
                           "parameter", PLAN_EXAMPLE),
}


def _untouched(model: torch.nn.Module) -> list[str]:
    failures = [f"{n} became a DTensor" for n, p in model.named_parameters() if isinstance(p, vescale.DTensor)]
    failures += [f"{n or 'the root'} got a hook" for n, m in model.named_modules()
                 if m._forward_hooks or m._forward_pre_hooks]
    return failures


def _correct_call_works(model: torch.nn.Module) -> list[str]:
    """After a failed call: the same module parallelizes with gpt_plan and computes the
    single-device logits."""
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(idx)
        parallelize_module(model, mesh("1d2"), gpt_plan())
        got = model(idx).full_tensor()
    err = mismatch(got, expected, rtol=1e-5, atol=1e-6)
    return [f"after the failed call, the correct one gives other logits: {err}"] if err else []


def _case_malformed(name: str) -> list[str]:
    plan, error, says, key, example = CASES[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    with pytest.raises(error) as raised:
        parallelize_module(model, mesh("1d2"), plan)
    message = str(raised.value)
    failures = []
    if not re.search(says, message):
        failures.append(f"the message does not say {says!r}: {message}")
    if key is not None and repr(key) not in message:
        failures.append(f"the message does not quote the key {key!r}: {message}")
    if example not in message:
        failures.append(f"the message does not show the right form {example}: {message}")
    return failures + _untouched(model) + _correct_call_works(model)


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_plan_entry_names_the_key(pool2, name):
    for failures in pool2.run(_case_malformed, name):
        assert not failures, "\n".join(failures)


def _case_more():
    failures = []
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    # a mesh of the wrong kind
    try:
        parallelize_module(model, "TP", gpt_plan())
        failures.append("a string mesh was accepted")
    except TypeError as e:
        if "expects a vescale.DeviceMesh" not in str(e):
            failures.append(f"wrong mesh: {e}")
    # a later entry is bad: nothing of the earlier ones happened
    plan = gpt_plan()
    plan["forward"][r"transformer\.ln_f\.output"] = [Replicate()]
    try:
        parallelize_module(model, mesh("1d2"), plan)
        failures.append("a bad last entry was accepted")
    except TypeError as e:
        if repr(r"transformer\.ln_f\.output") not in str(e):
            failures.append(f"bad last entry: {e}")
    failures += _untouched(model)
    # a Shard dim that does not fit an activation is found when the hook runs, naming the key
    bad = {"forward": {r"transformer\.ln_f\.output": [[Shard(5)]]}}
    parallelize_module(model, mesh("1d2"), bad)
    try:
        model(torch.zeros(2, 16, dtype=torch.long))
        failures.append("Shard(5) of a 3-d activation was accepted")
    except ValueError as e:
        for part in (repr(r"transformer\.ln_f\.output"), "(transformer.ln_f.output)", "out of range",
                     "range(-3, 3)"):
            if part not in str(e):
                failures.append(f"activation error lacks {part!r}: {e}")
    # the keyword form of inputs, and None for an argument, still work
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(idx)
    plan = gpt_plan()
    plan["forward"][r"transformer\.ln_f\.input"] = [None]
    plan["forward"][r"lm_head\.input"] = {"input": [Replicate()]}
    plan["forward"][r"transformer\.h\.0\.attn\.c_proj\.output"] = ([Partial()],)  # a tuple of one output
    parallelize_module(model, mesh("1d2"), plan)
    with torch.no_grad():
        err = mismatch(model(idx).full_tensor(), expected, rtol=1e-5, atol=1e-6)
    if err:
        failures.append(f"None / keyword / tuple forms: {err}")
    return failures


def test_mesh_late_entries_and_activation_errors(pool2):
    for failures in pool2.run(_case_more):
        assert not failures, "\n".join(failures)


@pytest.mark.parametrize("helper", [gpt_plan, llama_plan, gpt2_plan, bert_plan, t5_plan])
def test_plan_helpers_check_sequence_parallel(helper):
    with pytest.raises(TypeError, match=f"{helper.__name__}\\(sequence_parallel=...\\) takes True or False"):
        helper(sequence_parallel="yes")
    assert helper(sequence_parallel=True)["forward"]


def test_hf_plan_wants_a_model_instance():
    with pytest.raises(TypeError, match="hf_plan expects a model instance .* got the class GPT"):
        hf_plan(GPT)
    with pytest.raises(TypeError, match="hf_plan\\(sequence_parallel=...\\)"):
        hf_plan(GPT(GPTConfig()), sequence_parallel=None)
