"""vescale.Plan: the schema, its text and dict forms, and errors that name the key."""

from __future__ import annotations

import pytest
import torch

import vescale
from vescale import Plan, PlanError, Replicate, Shard
from vescale.parallel.plans import gpt_plan, llama_plan
from examples.models.llama import LlamaConfig, LlamaForCausalLM


def _plan() -> Plan:
    return Plan({"mesh": {"PP": 2, "DP": 1, "TP": 2},
                 "pipeline_parallel": {"split_points": ["model.layers.1", "model.layers.2", "model.layers.3"],
                                       "schedule": "interleaved_1f1b", "microbatches": 4, "virtual_stages": 2},
                 "tensor_parallel.sharding_plan": llama_plan(sequence_parallel=True),
                 "tensor_parallel.sequence_parallel": True,
                 "data_parallel.zero_stage": 2,
                 "mixed_precision.param_dtype": "bfloat16",
                 "gradient.clip_norm": 1.0})


def test_defaults_and_access():
    p = Plan()
    assert p.world_size == 1
    assert p["pipeline_parallel.schedule"] == "1f1b" and p.pipeline_parallel.microbatches == 1
    assert p.data_parallel.zero_stage == 0 and p.gradient.accumulation_steps == 1
    with pytest.raises(AttributeError, match="Plan.update"):
        p.pipeline_parallel.schedule = "gpipe"


def test_nested_and_dotted_forms_agree():
    nested = Plan({"pipeline_parallel": {"schedule": "zb_h1", "microbatches": 8}, "mesh": {"PP": 4}})
    dotted = Plan({"pipeline_parallel.schedule": "zb_h1", "pipeline_parallel.microbatches": 8, "mesh.PP": 4})
    assert nested == dotted


def test_dict_json_and_checkpoint_round_trips(tmp_path):
    p = _plan()
    assert Plan.from_dict(p.to_dict()) == p
    p.save(str(tmp_path / "plan.json"))
    assert Plan.load(str(tmp_path / "plan.json")) == p
    # placements are real placements again, from their text
    assert p["tensor_parallel.sharding_plan"]["parameter"][r"model\.embed_tokens\.weight"] == [Shard(0)]
    assert Plan.load(str(tmp_path / "plan.json"))["tensor_parallel.sharding_plan"]["forward"][
        r"model\.norm\.output"] == [[Replicate()]]
    # vescale.save / load keep it (checkpoints carry the plan), without a process group
    vescale.save(str(tmp_path / "ckpt"), {"plan": p})
    q = Plan()
    vescale.load(str(tmp_path / "ckpt"), {"plan": q})
    assert q == p


def test_print_is_one_line_per_setting():
    text = str(_plan())
    assert 'pipeline_parallel.split_points : ["model.layers.1", "model.layers.2", "model.layers.3"]' in text
    assert r'tensor_parallel.sharding_plan.parameter : model\.embed_tokens\.weight -> ["Shard(0)"]' in text
    assert 'mesh : {"PP": 2, "DP": 1, "TP": 2}' in text


@pytest.mark.parametrize("settings,message", [
    ({"pipline_parallel.schedule": "1f1b"}, "did you mean 'pipeline_parallel'"),
    ({"pipeline_parallel.schedul": "1f1b"}, "did you mean 'pipeline_parallel.schedule'"),
    ({"pipeline_parallel.schedule": "2f2b"}, "expected one of"),
    ({"pipeline_parallel.microbatches": 0}, "integer >= 1"),
    ({"data_parallel.zero_stage": 4}, "one of \\[0, 1, 2, 3\\]"),
    ({"mesh": {"DP": 0}}, "mesh.DP is 0"),
    ({"mesh": [2, 2]}, "dict of dim name"),
    ({"pipeline_parallel": "1f1b"}, None),  # a section given a non-dict: the error names the form
    ({"tensor_parallel.sharding_plan": {"parameter": {"a": "Shard(0)"}}}, "one placement per mesh dim"),
    ({"tensor_parallel.sharding_plan": {"parameter": {"a": ["Shard(x)"]}}}, "is not a placement"),
    ({"tensor_parallel.sharding_plan": {"forward": {"a.output": ["Replicate()"]}}}, "two brackets"),
    ({"tensor_parallel.sharding_plan": {"forwards": {}}}, "did you mean 'tensor_parallel.sharding_plan.forward'"),
    ({"tensor_parallel.sharding_plan": {"parameter": {"(a": ["Shard(0)"]}}}, "regular expression"),
    ({"version": 99}, "newer vescale"),
])
def test_malformed_entries_name_the_key(settings, message):
    with pytest.raises(PlanError) as e:
        Plan(settings)
    key = next(iter(settings))
    assert key.split(".")[0] in str(e.value) or key in str(e.value)
    if message:
        assert __import__("re").search(message, str(e.value)), str(e.value)


def test_validate_against_the_world_and_the_model():
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4))
    _plan().validate(world_size=4, model=model)
    with pytest.raises(PlanError, match="virtual_stages >= 2"):
        Plan({"mesh": {"PP": 2}, "pipeline_parallel.schedule": "interleaved_1f1b"}).validate()
    with pytest.raises(PlanError, match="multiple of 2"):
        Plan({"mesh": {"PP": 2}, "pipeline_parallel": {"schedule": "interleaved_1f1b", "virtual_stages": 2,
                                                       "microbatches": 3}}).validate()
    with pytest.raises(PlanError, match="holds 4 ranks but the world has 8"):
        _plan().validate(world_size=8)
    with pytest.raises(PlanError, match="did you mean 'model.layers.1'"):
        Plan({"mesh": {"PP": 2}, "pipeline_parallel.split_points": ["model.layer.1"]}).validate(model=model)
    with pytest.raises(PlanError, match="names 2 split points for 2 stages"):
        Plan({"mesh": {"PP": 2}, "pipeline_parallel.split_points": ["model.layers.0", "model.layers.1"]}).validate()
    with pytest.raises(PlanError, match="matches no parameter"):
        Plan({"mesh": {"TP": 2}, "tensor_parallel.sharding_plan": gpt_plan()}).validate(model=model)
    with pytest.raises(PlanError, match="out of range"):
        Plan({"mesh": {"TP": 2}, "tensor_parallel.sharding_plan": {"parameter": {r"lm_head\.weight": [Shard(2)]}}}
             ).validate(model=model)
    with pytest.raises(PlanError, match="not a dim of the mesh"):
        Plan({"mesh": {"DP": 4}, "tensor_parallel.sharding_plan": llama_plan()}).validate(world_size=4)
    assert torch.is_tensor(next(model.parameters()))
