"""Megatron-style tensor-parallel plans, as data for parallelize_module.

Column-parallel layers split their output features (weight and bias Shard(0)), the
row-parallel layer after them splits its input features (weight Shard(1)), so an
attention or MLP block needs one reduction of its output. The embedding and the
output projection split the vocabulary (vocabulary-parallel embedding; the loss is
then computed on vocabulary-split logits without gathering them).

With ``sequence_parallel`` the residual stream between blocks stays split along the
sequence (dim 1), so norms and dropout run on 1/TP of the tokens: each block gathers
its input and reduce-scatters its output instead of all-reducing it.

Names follow nanoGPT (``transformer.h.0.attn.c_attn``) and Hugging Face Llama
(``model.layers.0.self_attn.q_proj``). ``hf_plan`` derives a plan from a Hugging Face
model's own tensor-parallel plan (``config.base_model_tp_plan``); ``gpt2_plan``,
``bert_plan`` and ``t5_plan`` are written by hand for the Hugging Face models that ship
none.

Every plan here is for a 1-d tensor-parallel mesh: pass ``mesh["TP"]`` to
``parallelize_module`` and wrap the result in ``DDP(model, mesh["DP"])`` for DP x TP.
"""

from __future__ import annotations

import re

import torch.nn as nn

from ..placement_types import InterleavedShard, Replicate, Shard

__all__ = ["gpt_plan", "llama_plan", "hf_plan", "gpt2_plan", "bert_plan", "t5_plan"]

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _check_sequence_parallel(helper: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{helper}(sequence_parallel=...) takes True or False, got {value!r}")


def _blocks(block: str, attn: str, mlp: str, sequence_parallel: bool) -> dict:
    stream = S1 if sequence_parallel else R  # placement of the residual stream
    return {
        rf"{block}\.{attn}\.input": [[R]],
        rf"{block}\.{attn}\.output": [[stream]],
        rf"{block}\.{mlp}\.input": [[R]],
        rf"{block}\.{mlp}\.output": [[stream]],
    }


def gpt_plan(*, sequence_parallel: bool = False) -> dict:
    """nanoGPT: c_fc column-parallel, c_proj row-parallel, and the fused c_attn split
    within each of its q, k and v blocks (``InterleavedShard(0, 3)``), so that every rank
    runs its own heads with no gather."""
    _check_sequence_parallel("gpt_plan", sequence_parallel)
    h = r"transformer\.h\.\d+"
    forward = _blocks(h, "attn", "mlp", sequence_parallel)
    forward[r"transformer\.drop\.output"] = [[S1 if sequence_parallel else R]]
    forward[r"transformer\.ln_f\.output"] = [[R]]
    return {
        "parameter": {
            rf"{h}\.attn\.c_attn\.(weight|bias)": [InterleavedShard(0, 3)],
            rf"{h}\.attn\.c_proj\.weight": [S1],
            rf"{h}\.mlp\.c_fc\.(weight|bias)": [S0],
            rf"{h}\.mlp\.c_proj\.weight": [S1],
            r"lm_head\.weight": [S0],  # tied with transformer.wte: vocabulary-parallel embedding
        },
        "forward": forward,
    }


def llama_plan(*, sequence_parallel: bool = False) -> dict:
    """Hugging Face Llama: q/k/v and gate/up column-parallel, o/down row-parallel."""
    _check_sequence_parallel("llama_plan", sequence_parallel)
    layer = r"model\.layers\.\d+"
    forward = _blocks(layer, "self_attn", "mlp", sequence_parallel)
    forward[r"model\.embed_tokens\.output"] = [[S1 if sequence_parallel else R]]
    forward[r"model\.norm\.output"] = [[R]]
    return {
        "parameter": {
            rf"{layer}\.self_attn\.(q|k|v)_proj\.weight": [S0],
            rf"{layer}\.self_attn\.o_proj\.weight": [S1],
            rf"{layer}\.mlp\.(gate|up)_proj\.weight": [S0],
            rf"{layer}\.mlp\.down_proj\.weight": [S1],
            r"model\.embed_tokens\.weight": [S0],
            r"lm_head\.weight": [S0],
        },
        "forward": forward,
    }


# ---- Hugging Face models ------------------------------------------------------------------

# transformers' tensor-parallel styles (transformers/distributed/tensor_parallel.py) as
# (how the parameters split, what the module's output becomes). "col": the output
# features split (weight Shard(out dim), bias Shard(0)); "row": the input features split
# (weight Shard(in dim), bias replicated); "packed_col" / "packed_row": the same within
# each of the two blocks of a packed gate|up weight (InterleavedShard(dim, 2)). Output:
# "gather" -> Replicate; "stream" -> the residual stream's placement (Replicate, or Shard(1) with sequence parallelism); None
# leaves it to the engine. vescale tracks every placement itself, so the styles that in
# transformers exist to run a module on local tensors and fix up its gradients by hand
# (replicated_with_grad_allreduce, moe_tp_experts, ...) need nothing here: the engine
# already reduces the gradient of a replicated parameter used on sharded activations.
_HF_STYLES = {
    "colwise": ("col", None),
    "colwise_gather_output": ("col", "gather"),
    "colwise_rep": ("col", "gather"),
    "packed_colwise": ("packed_col", None),
    "packed_rowwise": ("packed_row", "stream"),
    "rowwise": ("row", "stream"),
    "rowwise_rep": ("row", "gather"),
    "rowwise_split_input": ("row", "gather"),
    "embedding_rowwise": ("vocab", "stream"),
    "embedding_colwise": ("hidden", "stream"),
    "all_reduce": (None, "gather"),
    # The module runs on the stream as it comes: with sequence_parallel=True the
    # embeddings and row-parallel layers already leave it split along the sequence (an
    # input hook here would take a plain tensor for this rank's part of the sequence).
    "sequence_parallel": (None, None),
    "replicated_with_grad_allreduce": (None, None),
    "replicate": (None, None),
    "moe_tp_experts": (None, None),
    "moe_identity_expert": (None, None),
    "mla_kv_a_proj": (None, None),
    "local_params": (None, None),
}

# Styles that vescale cannot express yet (refused rather than mapped onto something that
# would run, but without the parallelism the plan asks for).
_HF_UNSUPPORTED = {
    "grouped_gemm": "it is an expert-parallel style; vescale has no expert parallelism yet",
    "ep_dispatch_experts": "it is an expert-parallel style; vescale has no expert parallelism yet",
}


def _hf_tp_plan(model) -> dict:
    """The model's whole TP plan, FQN patterns relative to ``model``: the class's own
    ``_tp_plan`` (lm_head), the base model's ``config.base_model_tp_plan`` under its prefix,
    as transformers resolves it (``model.tp_plan``) where it can."""
    resolved = getattr(model, "tp_plan", None)
    if isinstance(resolved, dict) and resolved:
        return dict(resolved)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    plan.update({f"{prefix}{k}": v for k, v in base_plan.items()})
    return plan


def _key_regex(key: str) -> str:
    """A transformers plan key ("model.layers.*.mlp.up_proj", ``*`` for a layer index) as
    a regular expression over FQNs."""
    return re.escape(key).replace(r"\*", r"\d+")


def _is_conv1d(module) -> bool:
    # transformers' Conv1D (GPT-2) stores its weight as (in_features, out_features).
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _split_placement(kind: str, param_name: str, tensor, module, key: str, style: str):
    if kind.startswith("packed_"):  # the same split within each of the two packed blocks
        plain = _split_placement(kind[len("packed_"):], param_name, tensor, module, key, style)
        return InterleavedShard(plain.dim, 2) if isinstance(plain, Shard) else plain
    if kind in ("vocab", "hidden"):
        return Shard(0 if kind == "vocab" else 1) if param_name == "weight" else Replicate()
    if tensor.dim() == 1:  # a bias (or a packed 1-d parameter)
        return Shard(0) if kind == "col" else Replicate()
    if _is_conv1d(module) and param_name == "weight":
        return Shard(1) if kind == "col" else Shard(0)
    if tensor.dim() < 2:
        raise ValueError(f"hf_plan: {key!r} is {style!r} but {param_name} has shape {tuple(tensor.shape)}; "
                         f"{style} splits weights of 2 or more dims")
    # nn.Linear and expert stacks (experts, out, in): out is dim -2, in is dim -1.
    return Shard(tensor.dim() - 2) if kind == "col" else Shard(tensor.dim() - 1)


def hf_plan(model, *, sequence_parallel: bool = False) -> dict:
    """A vescale plan derived from a Hugging Face model's own tensor-parallel plan.

    Reads ``config.base_model_tp_plan`` (module patterns of the base model, prefixed with
    ``base_model_prefix``) and the model class's ``_tp_plan`` (the LM head), as transformers
    merges them (``model.tp_plan``), and maps each style onto placements for a 1-d TP mesh:
    "colwise" splits a Linear's output features (weight ``Shard(0)``, bias ``Shard(0)``),
    "rowwise" its input features (weight ``Shard(1)``, bias replicated; the output is
    reduced at the module's exit), "colwise_gather_output" (the LM head) gathers its
    output, "embedding_rowwise" is a vocabulary-parallel embedding. With
    ``sequence_parallel`` the residual stream between blocks is split along the sequence
    (dim 1): embeddings and row-parallel layers reduce-scatter their outputs and
    column-parallel layers gather their inputs.

    A style vescale cannot express (expert parallelism) raises
    ``NotImplementedError``; an unknown style raises ``ValueError``; both name the key.

    Whatever the mapping, values stay exact: parameters take plain Shard/Replicate
    layouts, and the hooks only move DTensors (the outputs of modules whose weights are
    split) or take a plain tensor as replicated (column-parallel inputs). The
    styles of the zoo's models (colwise, rowwise, colwise_gather_output,
    rowwise_split_input (Phi-3's fused projections), embedding_rowwise,
    replicated_with_grad_allreduce) are checked against single-device
    training and generation by tests/python/test_zoo.py; the others are mapped by the
    same reading of transformers' styles but no model there uses them.
    """
    _check_sequence_parallel("hf_plan", sequence_parallel)
    if not isinstance(model, nn.Module):
        what = f"the class {model.__name__}" if isinstance(model, type) else f"{model!r} of type {type(model).__name__}"
        raise TypeError(f"hf_plan expects a model instance (e.g. LlamaForCausalLM(config)), got {what}")
    tp = _hf_tp_plan(model)
    if not tp:
        raise ValueError(f"hf_plan: {type(model).__name__} ships no tensor-parallel plan (its config's "
                         f"base_model_tp_plan is empty); write one by hand, as gpt2_plan, bert_plan or t5_plan do")
    stream = Shard(1) if sequence_parallel else Replicate()
    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    parameter: dict = {}
    forward: dict = {}
    for key, style in tp.items():
        if style in _HF_UNSUPPORTED:
            raise NotImplementedError(f"hf_plan: {type(model).__name__}'s tp plan gives {key!r} the style "
                                      f"{style!r}, which vescale cannot shard as intended: "
                                      f"{_HF_UNSUPPORTED[style]}. Write a plan by hand for this model.")
        if style not in _HF_STYLES:
            raise ValueError(f"hf_plan: {type(model).__name__}'s tp plan gives {key!r} the style {style!r}, which "
                             f"vescale does not know; known styles: {sorted(_HF_STYLES)} (not supported yet: "
                             f"{sorted(_HF_UNSUPPORTED)})")
        kind, out = _HF_STYLES[style]
        rx = _key_regex(key)
        compiled = re.compile(rx)
        hit_params = [n for n in params if compiled.fullmatch(n)]
        hit_modules = [n for n in modules if compiled.fullmatch(n)]
        if hit_params and kind in ("col", "row", "packed_col", "packed_row"):  # the key names a parameter (an expert stack)
            owner_name, _, pname = hit_params[0].rpartition(".")
            parameter[rx] = [_split_placement(kind, pname, params[hit_params[0]], modules[owner_name], key, style)]
            continue
        if not hit_modules:
            continue  # an optional module this configuration leaves out
        if kind in ("col", "row", "vocab", "hidden", "packed_col", "packed_row"):
            names = {}
            for m in hit_modules:
                for pname, p in modules[m].named_parameters(recurse=False):
                    names.setdefault(pname, _split_placement(kind, pname, p, modules[m], key, style))
            for pname, placement in names.items():
                if placement != Replicate():
                    parameter[rf"{rx}\.{re.escape(pname)}"] = [placement]
        if kind in ("col", "packed_col") and sequence_parallel:
            forward[rf"{rx}\.input"] = [[Replicate()]]
        if out == "gather":
            forward[rf"{rx}\.output"] = [[Replicate()]]
        elif out == "stream":
            forward[rf"{rx}\.output"] = [[stream]]
    return {"parameter": parameter, "forward": forward}


def gpt2_plan(*, sequence_parallel: bool = False) -> dict:
    """Hugging Face GPT-2 (``GPT2LMHeadModel``, Conv1D layers with (in, out) weights).

    c_fc column-parallel (weight ``Shard(1)``), the c_proj layers row-parallel (weight
    ``Shard(0)``), vocabulary-parallel wte (tied with lm_head), logits gathered. The fused
    c_attn is split within each of its q, k and v blocks (weight ``InterleavedShard(1, 3)``,
    bias ``InterleavedShard(0, 3)``), so every rank runs its own heads."""
    _check_sequence_parallel("gpt2_plan", sequence_parallel)
    h = r"transformer\.h\.\d+"
    stream = S1 if sequence_parallel else R
    forward = {
        r"transformer\.wte\.output": [[R]],  # the sum of partial lookups; wpe is added after
        r"transformer\.drop\.output": [[stream]],
        rf"{h}\.attn\.input": [[R]],
        rf"{h}\.attn\.output": [[stream]],
        rf"{h}\.mlp\.input": [[R]],
        rf"{h}\.mlp\.output": [[stream]],
        r"transformer\.ln_f\.output": [[R]],
        r"lm_head\.output": [[R]],
    }
    return {
        "parameter": {
            rf"{h}\.attn\.c_attn\.weight": [InterleavedShard(1, 3)],
            rf"{h}\.attn\.c_attn\.bias": [InterleavedShard(0, 3)],
            rf"{h}\.attn\.c_proj\.weight": [S0],
            rf"{h}\.mlp\.c_fc\.weight": [S1],
            rf"{h}\.mlp\.c_fc\.bias": [S0],
            rf"{h}\.mlp\.c_proj\.weight": [S0],
            r"transformer\.wte\.weight": [S0],  # tied with lm_head.weight
        },
        "forward": forward,
    }


def bert_plan(*, sequence_parallel: bool = False) -> dict:
    """Hugging Face BERT (``BertForMaskedLM``): query/key/value and intermediate
    column-parallel, the two output denses row-parallel, vocabulary-parallel word
    embeddings (tied with the MLM decoder), logits gathered."""
    _check_sequence_parallel("bert_plan", sequence_parallel)
    layer = r"bert\.encoder\.layer\.\d+"
    stream = S1 if sequence_parallel else R
    return {
        "parameter": {
            rf"{layer}\.attention\.self\.(query|key|value)\.(weight|bias)": [S0],
            rf"{layer}\.attention\.output\.dense\.weight": [S1],
            rf"{layer}\.intermediate\.dense\.(weight|bias)": [S0],
            rf"{layer}\.output\.dense\.weight": [S1],
            r"bert\.embeddings\.word_embeddings\.weight": [S0],  # tied with cls.predictions.decoder.weight
            r"cls\.predictions\.(decoder\.)?bias": [S0],  # one tensor under two names
        },
        "forward": {
            r"bert\.embeddings\.word_embeddings\.output": [[R]],
            r"bert\.embeddings\.output": [[stream]],
            rf"{layer}\.attention\.self\.input": [[R]],
            rf"{layer}\.attention\.output\.dense\.output": [[stream]],
            rf"{layer}\.intermediate\.input": [[R]],
            rf"{layer}\.output\.dense\.output": [[stream]],
            r"cls\.predictions\.decoder\.input": [[R]],
            r"cls\.predictions\.decoder\.output": [[R]],
        },
    }


def t5_plan(*, sequence_parallel: bool = False) -> dict:
    """Hugging Face T5 (``T5ForConditionalGeneration``, encoder and decoder): q/k/v and wi
    column-parallel, o and wo row-parallel, the relative position bias split by head (its
    heads meet the attention scores' heads), vocabulary-parallel shared embedding (tied
    with lm_head), logits gathered."""
    _check_sequence_parallel("t5_plan", sequence_parallel)
    block = r"(encoder|decoder)\.block\.\d+\.layer\.\d+"
    stream = S1 if sequence_parallel else R
    return {
        "parameter": {
            rf"{block}\.(SelfAttention|EncDecAttention)\.(q|k|v)\.weight": [S0],
            rf"{block}\.(SelfAttention|EncDecAttention)\.o\.weight": [S1],
            rf"{block}\.SelfAttention\.relative_attention_bias\.weight": [S1],
            rf"{block}\.DenseReluDense\.wi\.weight": [S0],
            rf"{block}\.DenseReluDense\.wo\.weight": [S1],
            r"shared\.weight": [S0],  # tied with encoder/decoder.embed_tokens and lm_head
        },
        "forward": {
            r"(encoder|decoder)\.embed_tokens\.output": [[stream]],
            rf"{block}\.(SelfAttention|EncDecAttention|DenseReluDense)\.input": [[R]],
            rf"{block}\.(SelfAttention|EncDecAttention|DenseReluDense)\.output": [[stream]],
            r"(encoder|decoder)\.final_layer_norm\.output": [[R]],
            r"lm_head\.output": [[R]],
        },
    }
