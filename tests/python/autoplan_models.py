"""The small models and the synthetic communication table the planner tests share
(test_autoplan*.py): the project's GPT and Llama, Hugging Face Llama / GPT-2 / Qwen2 from
small configs, and token batches for them."""

import torch

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM
from vescale import Replicate
from vescale.autoplan import CommModel

# Any alpha-beta table will do for the choices below: the pairs win by a margin (fewer and
# smaller collectives), whatever the backend's numbers.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
COMM = CommModel({(k, g): (300e-6 * (g - 1), 1e-9 * (g - 1)) for k in KINDS for g in (2, 4)}, source="synthetic")
SEQ, BATCH, VOCAB = 16, 8, 64
R = Replicate()


def tokens(seed: int = 3, n: int = BATCH):
    d = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return d[:, :-1].contiguous(), d[:, 1:].contiguous()


def gpt(bias: bool = False):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=32, bias=bias))


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ))


def hf(name: str):
    import transformers as tf
    torch.manual_seed(0)
    if name == "hf-llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                  max_position_embeddings=SEQ))
    if name == "gpt2":
        # no dropout: with attention dropout the CPU runs the math attention, whose reshapes
        # make InterleavedShard of c_attn cost gathers (the what-if runs see that too)
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    # "qwen2-no-cache" trains without a KV cache, as training scripts do: transformers'
    # mask code then reads whether the positions are packed sequences out of a tensor,
    # which the what-if runs on meta take from the profile (vescale/autoplan/scalars.py)
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              max_position_embeddings=SEQ, use_cache=name != "qwen2-no-cache"))
