"""Profile model A, plan model B (vescale/autoplan/transfer.py): a deeper and wider model,
built on meta and never run, planned from a smaller one's timings. What follows from
shapes (units, parameters, saved and sent bytes, FLOPs, cuts, the tensor-parallel
layouts and their collectives) must equal what the model's own profile and what-if runs
give; the times must be the smaller model's, scaled by FLOPs as documented. No timing is
compared with a measurement: the machine is shared."""

import statistics

import pytest
import torch

import vescale
from vescale import PlanError
from vescale.autoplan import plan_eager, profile_model
from vescale.autoplan.transfer import profile_like

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM
from autoplan_models import BATCH, COMM, SEQ, VOCAB, tokens


def _gpt(layers: int, width: int):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=layers, n_head=4, n_embd=width, bias=False))


def _llama(layers: int, width: int):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ))


def _qwen2(layers: int, width: int):
    import transformers as tf
    torch.manual_seed(0)
    # no KV cache: transformers' mask code reads a value out of a tensor, replayed on meta
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=SEQ, use_cache=False))


def _hf_batch():
    x, _ = tokens()
    return {"input_ids": x, "labels": x}


MODELS = {"gpt": (_gpt, tokens), "llama": (_llama, tokens), "qwen2": (_qwen2, _hf_batch)}


def _on_meta(make, *args):
    with torch.device("meta"):
        return make(*args)


def _close(a: float, b: float, rel: float = 1e-9, abs_: float = 1e-12) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + abs_


@pytest.mark.parametrize("name", list(MODELS))
def test_a_profile_scaled_from_a_smaller_model(name):
    make, batch = MODELS[name]
    small = profile_model(make(2, 32), batch(), steps=1)
    derived = profile_like(small, _on_meta(make, 4, 64), batch())   # twice as deep and twice as wide
    own = profile_model(make(4, 64), batch(), steps=1)
    assert derived.derived["from"] == small.model_class
    # what shapes decide: as the model's own profile has it
    assert [(u.name, u.kind, u.cls, u.param_bytes, u.param_numel, u.params) for u in derived.units] == \
           [(u.name, u.kind, u.cls, u.param_bytes, u.param_numel, u.params) for u in own.units]
    for d, o in zip(derived.units, own.units):
        for what in ("saved", "out_bytes", "flops"):
            assert all(_close(x, y, 1e-6) for x, y in zip(getattr(d, what), getattr(o, what))), (d.name, what)
        assert d.ops == o.ops and d.side_inputs == o.side_inputs, d.name
    assert (derived.legal_cuts, derived.tied, derived.glue_params, derived.param_bytes) == \
           (own.legal_cuts, own.tied, own.glue_params, own.param_bytes)
    assert [(lin.name, lin.fused) for lin in derived.linears] == [(lin.name, lin.fused) for lin in own.linears]
    assert derived.backward_ops == own.backward_ops
    # what takes a clock: the smaller model's, the per-sample part scaled by the FLOPs
    small_blocks = small.blocks_list
    for u in derived.blocks_list:
        names, r = derived.derived["units"][u.name]
        assert names == [b.name for b in small_blocks]
        # 2x wider: 4x the FLOPs of the matmuls, 2x those of attention (counted too)
        assert _close(r, u.flops[1] / small_blocks[0].flops[1]) and 3 < r < 4
        for what in ("forward", "backward"):
            a = statistics.median(getattr(b, what)[0] for b in small_blocks)
            b = statistics.median(getattr(b, what)[1] for b in small_blocks) * r
            assert _close(getattr(u, what)[0], a) and _close(getattr(u, what)[1], b), (u.name, what)
    for u in derived.units:
        if u.kind != "block":
            names, r = derived.derived["units"][u.name]
            assert names == [u.name]  # the same embedding / head by name
    assert derived.optimizer == small.optimizer and derived.scalars == small.scalars
    # the peak of a step (malloc's counters, where glibc has them): within 15% of B's own
    if own.working != (0.0, 0.0):
        x, y = (w[0] + w[1] * BATCH for w in (derived.working, own.working))
        assert abs(x / y - 1) < 0.15, (derived.working, own.working)
    assert "times scaled from" in derived.summary()


def test_planning_a_model_on_meta_from_a_smaller_ones_timings():
    """The layouts of a model planned without running it: the same tensor-parallel choices,
    collectives and per-rank parameter bytes as its own what-if runs find, the saved bytes
    within 1% plus 256 bytes (a meta run counts a 128-byte position index once more than a
    real one), the times the smaller model's scaled."""
    small = plan_eager(_gpt(2, 32), tokens(), world=4, comm=COMM, steps=1)
    meta = _on_meta(_gpt, 4, 64)
    derived = plan_eager(meta, tokens(), world=4, comm=COMM, like=small)
    own = plan_eager(_gpt(4, 64), tokens(), world=4, comm=COMM, steps=1)
    assert "not run here: times scaled from GPT's profile" in str(derived)
    assert derived.ranked and len(derived.ranked) == len(own.ranked)
    assert {k: ch.placements for k, ch in derived.tp_choices.items()} == \
           {k: ch.placements for k, ch in own.tp_choices.items()}
    index = {u.name: i for i, u in enumerate(small.profile.units)}
    for d_layout, o_layout in zip(derived.problem["layouts"], own.problem["layouts"]):
        assert (d_layout["tp"], d_layout["sp"]) == (o_layout["tp"], o_layout["sp"])
        s_layout = next(x for x in small.problem["layouts"] if (x["tp"], x["sp"]) == (d_layout["tp"], d_layout["sp"]))
        for u, d, o in zip(derived.profile.units, d_layout["units"], o_layout["units"]):
            for key in ("fwd_comm", "bwd_comm", "param_bytes", "param_numel", "partial_grad_bytes", "out"):
                assert d.get(key) == o.get(key), (d_layout["tp"], d_layout["sp"], u.name, key)
            # at the full batch (a real run's smaller batch is a view of it, whose whole
            # storage counts where the view is saved: 1 KiB of token ids)
            x, y = (line[0] + line[1] * BATCH for line in (d["saved"], o["saved"]))
            assert _close(x, y, 0.01, 256), (d_layout["tp"], u.name, d["saved"], o["saved"])
            names, r = derived.profile.derived["units"][u.name]
            fwd = [s_layout["units"][index[n]]["fwd"] for n in names]
            assert _close(d["fwd"][0], statistics.median(a for a, _ in fwd))
            assert _close(d["fwd"][1], statistics.median(b for _, b in fwd) * r)
    # and a Plan of it that validates for the model
    plan = derived.to_plan()
    plan.validate(world_size=4, model=_gpt(4, 64))


def test_a_model_unlike_the_profiled_one_is_refused():
    small = plan_eager(_gpt(2, 32), tokens(), world=4, comm=COMM, steps=1,
                       constraints={"tensor_parallel.size": 2})
    with pytest.raises(PlanError, match=r"class DecoderLayer.*\(GPT\) does not have.*same kinds of modules"):
        plan_eager(_on_meta(_llama, 4, 64), tokens(), world=4, comm=COMM, like=small)
    with pytest.raises(PlanError, match="lives on meta.*like="):
        plan_eager(_on_meta(_gpt, 4, 64), tokens(), world=4, comm=COMM)
    with pytest.raises(PlanError, match="planned for 4 ranks, not 2"):
        plan_eager(_on_meta(_gpt, 4, 64), tokens(), world=2, comm=COMM, like=small)
    # a degree the profiled model was not planned at: refused with the reason, the rest planned
    result = plan_eager(_on_meta(_gpt, 4, 64), tokens(), world=4, comm=COMM, like=small)
    assert result.ranked and all(c.config["tp"] in (1, 2) for c in result.ranked)
    assert any("no timings at TP 4" in c.verdict for c in result.rejected)
    assert isinstance(vescale.generate_plan({"mesh.TP": 2}, _on_meta(_gpt, 4, 64), sample_batch=tokens(), world=4,
                                            comm=COMM, like=small), vescale.Plan)
