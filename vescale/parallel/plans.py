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
(``model.layers.0.self_attn.q_proj``).
"""

from __future__ import annotations

from ..placement_types import Replicate, Shard

__all__ = ["gpt_plan", "llama_plan"]

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _blocks(block: str, attn: str, mlp: str, sequence_parallel: bool) -> dict:
    stream = S1 if sequence_parallel else R  # placement of the residual stream
    return {
        rf"{block}\.{attn}\.input": [[R]],
        rf"{block}\.{attn}\.output": [[stream]],
        rf"{block}\.{mlp}\.input": [[R]],
        rf"{block}\.{mlp}\.output": [[stream]],
    }


def gpt_plan(*, sequence_parallel: bool = False) -> dict:
    """nanoGPT: fused c_attn and c_fc column-parallel, c_proj row-parallel."""
    h = r"transformer\.h\.\d+"
    forward = _blocks(h, "attn", "mlp", sequence_parallel)
    forward[r"transformer\.drop\.output"] = [[S1 if sequence_parallel else R]]
    forward[r"transformer\.ln_f\.output"] = [[R]]
    return {
        "parameter": {
            rf"{h}\.attn\.c_attn\.(weight|bias)": [S0],
            rf"{h}\.attn\.c_proj\.weight": [S1],
            rf"{h}\.mlp\.c_fc\.(weight|bias)": [S0],
            rf"{h}\.mlp\.c_proj\.weight": [S1],
            r"lm_head\.weight": [S0],  # tied with transformer.wte: vocabulary-parallel embedding
        },
        "forward": forward,
    }


def llama_plan(*, sequence_parallel: bool = False) -> dict:
    """Hugging Face Llama: q/k/v and gate/up column-parallel, o/down row-parallel."""
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
