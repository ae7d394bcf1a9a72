"""What several benchmarks share: a free port for their gloo ranks, and the GPT's
tensor-parallel plan in torch's own terms (the peer of vescale's gpt_plan)."""

from __future__ import annotations

import socket

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_gpt_tp(model, tp_mesh) -> None:
    """gpt_plan in torch's terms: Megatron attention and MLP, vocabulary-parallel tied
    embedding / output projection, logits left split over the vocabulary (for
    loss_parallel). nanoGPT splits c_attn's output into q, k, v by global sizes, which
    needs the whole dim: vescale gathers it there (split's rule), so torch's c_attn
    gathers its output too, and attention runs on plain replicated tensors (torch's
    DTensor has no rule for the CPU flash-attention kernel, so it could not stay a
    DTensor anyway)."""
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.transformer.h)):
        h = f"transformer.h.{i}"
        plan.update({f"{h}.attn.c_attn": ColwiseParallel(output_layouts=Replicate()),
                     f"{h}.attn.c_proj": RowwiseParallel(input_layouts=Replicate()),
                     f"{h}.mlp.c_fc": ColwiseParallel(), f"{h}.mlp.c_proj": RowwiseParallel()})
    parallelize_module(model, tp_mesh, plan)
    # torch distributes the two names of the tied weight separately (both Shard(0)): tie them again
    model.transformer.wte.weight = model.lm_head.weight
