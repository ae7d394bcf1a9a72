"""vescale.generate_plan, the eager planner, part 2: the search respects every constraint,
recomputes where nothing fits without it, splits by the asked method under memory limits,
and refuses unknown or bad constraints."""

import pytest

import vescale
from vescale import Plan, PlanError
from vescale.autoplan import plan_eager, profile_model
from vescale.autoplan.eager import CONSTRAINTS

from autoplan_models import COMM, gpt, tokens


# ---- the search and its constraints ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_profile():
    model = gpt()
    return model, profile_model(model, tokens(), steps=1)


def _plan(model, prof, constraints):
    return plan_eager(model, tokens(), world=4, comm=COMM, constraints=constraints, profile=prof, steps=1)


def _check(c, k: dict) -> None:
    cfg = c.config
    want = {"mesh.PP": cfg["pp"], "mesh.DP": cfg["dp"], "mesh.TP": cfg["tp"], "pipeline_parallel.size": cfg["pp"],
            "data_parallel.size": cfg["dp"], "tensor_parallel.size": cfg["tp"],
            "data_parallel.zero_stage": cfg["zero"], "tensor_parallel.sequence_parallel": bool(cfg["sp"])}
    for key, value in k.items():
        if key in want:
            assert want[key] == value, (key, value, c.label)
        elif key == "pipeline_parallel.schedule":
            assert cfg["pp"] == 1 or cfg["schedule"] == value, c.label
        elif key == "pipeline_parallel.microbatches":
            assert cfg["pp"] == 1 and value == 1 or cfg["microbatches"] == value, c.label
        elif key == "pipeline_parallel.virtual_stages":
            assert cfg["vp"] == value, c.label
        elif key == "memory_per_device":
            assert c.memory["total"] <= value, c.label
        elif key == "recompute":
            assert bool(cfg["recompute"]) == value, c.label


@pytest.mark.parametrize("constraints", [
    {"mesh.TP": 2},
    {"tensor_parallel.size": 4, "tensor_parallel.sequence_parallel": True},
    {"mesh.PP": 2, "pipeline_parallel.schedule": "1f1b", "pipeline_parallel.microbatches": 4},
    {"pipeline_parallel.schedule": "interleaved_1f1b", "pipeline_parallel.virtual_stages": 2},
    {"data_parallel.zero_stage": 3},
    {"mesh.DP": 2, "data_parallel.zero_stage": 2, "tensor_parallel.sharding_policy": "megatron"},
    {"world_size": 4, "memory_per_device": 900_000},
    {"mesh.PP": 1, "recompute": True},
], ids=["tp2", "tp4-sp", "pp2-1f1b-m4", "interleaved", "zero3", "dp2-zero2", "memory", "recompute"])
def test_the_search_respects_every_constraint(gpt_profile, constraints):
    model, prof = gpt_profile
    result = _plan(model, prof, constraints)
    assert result.ranked, [c.verdict for c in result.rejected]
    for c in result.ranked:
        _check(c, constraints)
    plan = result.to_plan()
    plan.validate(world_size=4, model=model)
    text = repr(plan)
    assert "# predicted best: " + result.best.label in text
    assert ("runners-up" in text) == (len(result.ranked) > 1)


def test_recomputation_where_nothing_fits_without_it(gpt_profile):
    model, prof = gpt_profile
    plain = _plan(model, prof, {"mesh.PP": 1})
    assert not any(c.config["recompute"] for c in plain.ranked)  # it never makes a step faster
    recomputed = _plan(model, prof, {"mesh.PP": 1, "recompute": True})
    least = min(c.memory["total"] for c in plain.ranked)
    assert min(c.memory["total"] for c in recomputed.ranked) < least
    limited = _plan(model, prof, {"mesh.PP": 1, "memory_per_device": int(0.97 * least)})
    assert limited.ranked and all(c.config["recompute"] and c.memory["total"] <= 0.97 * least
                                  for c in limited.ranked)
    assert "recompute.modules : []" not in repr(limited.to_plan())
    # under a pipeline too: recomputation saves memory there and costs time
    piped_plain = _plan(model, prof, {"mesh.PP": 2, "recompute": False})
    piped = _plan(model, prof, {"mesh.PP": 2, "recompute": True})
    assert piped.ranked and all(c.config["recompute"] for c in piped.ranked)
    assert min(c.memory["total"] for c in piped.ranked) < min(c.memory["total"] for c in piped_plain.ranked)
    assert piped.best.step_s > piped_plain.best.step_s
    assert "recompute.modules : []" not in repr(piped.to_plan())


def test_split_methods_and_memory_limits(gpt_profile):
    model, prof = gpt_profile
    free = _plan(model, prof, {"mesh.PP": 4, "pipeline_parallel.split_method": "uniform"})
    assert all(c.config["blocks_per_stage"] == [1, 1, 1, 1] for c in free.ranked)
    # a limit below every plan's need: refused, and the error says why
    result = _plan(model, prof, {"memory_per_device": 1000})
    assert not result.ranked and all("limit" in c.verdict or "ZB-V with ZeRO-3" in c.verdict for c in result.rejected)
    with pytest.raises(PlanError, match="no plan for GPT fits"):
        result.best
    # a limit between plans: the ones above it are refused, none of those ranked exceeds it
    all_plans = _plan(model, prof, {})
    totals = sorted(c.memory["total"] for c in all_plans.ranked)
    limit = totals[len(totals) // 2]
    limited = _plan(model, prof, {"memory_per_device": limit})
    assert limited.ranked and max(c.memory["total"] for c in limited.ranked) <= limit
    assert len(limited.ranked) < len(all_plans.ranked)


def test_unknown_and_bad_constraints_are_refused(gpt_profile):
    model, prof = gpt_profile
    with pytest.raises(PlanError) as e:
        _plan(model, prof, {"pipeline_parallel.splits": "flops"})
    assert "pipeline_parallel.split_method" in str(e.value) and "valid keys" in str(e.value)
    for key in CONSTRAINTS:
        assert key in str(e.value)
    bad = [({"mesh.TP": 3}, "does not divide"), ({"data_parallel.zero_stage": 5}, "0, 1, 2 or 3"),
           ({"tensor_parallel.sharding_policy": "magic"}, "megatron"), ({"memory_per_device": "lots"}, "bytes"),
           ({"pipeline_parallel.schedule": "1f2b"}, "1f1b"), ({"world_size": 8}, "world"),
           ({"pipeline_parallel.split_method": "random"}, "uniform")]
    for constraints, words in bad:
        with pytest.raises(PlanError, match=words):
            _plan(model, prof, constraints)


def test_vescale_generate_plan_takes_either_argument_order(gpt_profile):
    model, _ = gpt_profile
    plan = vescale.generate_plan({"mesh.DP": 4}, model, sample_batch=tokens(), world=4, comm=COMM, steps=1)
    assert isinstance(plan, Plan) and plan["mesh"] == {"DP": 4}
    plan2 = vescale.generate_plan(model, {"mesh.DP": 4}, sample_batch=tokens(), world=4, comm=COMM, steps=1)
    assert plan2["mesh"] == {"DP": 4}
    with pytest.raises(PlanError, match="sample batch"):
        vescale.generate_plan({}, model, world=4, comm=COMM)
