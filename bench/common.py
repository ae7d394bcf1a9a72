"""What several benchmarks share: a free port for their gloo ranks, and the GPT's
tensor-parallel plan in torch's own terms (the peer of vescale's gpt_plan)."""

from __future__ import annotations

import socket

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_gpt_tp(model, tp_mesh, sequence_parallel: bool = False) -> None:
    """gpt_plan in torch's terms: Megatron attention and MLP, vocabulary-parallel tied
    embedding / output projection, logits left split over the vocabulary (for
    loss_parallel). nanoGPT splits c_attn's output into q, k, v by global sizes, which
    needs the whole dim: vescale gathers it there (split's rule), so torch's c_attn
    gathers its output too, and attention runs on plain replicated tensors (torch's
    DTensor has no rule for the CPU flash-attention kernel, so it could not stay a
    DTensor anyway)."""
    if sequence_parallel:
        return _torch_gpt_tp_sp(model, tp_mesh)
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


def _torch_gpt_tp_sp(model, tp_mesh) -> None:
    """gpt_plan(sequence_parallel=True) in torch's terms: the residual stream split over the
    sequence between blocks (LayerNorms on sequence shards: torch's SequenceParallel), the
    attention and MLP inputs gathered, their row-parallel outputs reduce-scattered back to
    sequence shards; the position embedding's output split over its positions so that it
    adds to the token embedding's shard."""
    seq = (Shard(1),)
    gather = dict(input_layouts=seq, desired_input_layouts=(Replicate(),))
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "transformer.wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "transformer.ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.transformer.h)):
        h = f"transformer.h.{i}"
        plan.update({f"{h}.ln_1": SequenceParallel(), f"{h}.ln_2": SequenceParallel(),
                     f"{h}.attn": PrepareModuleInput(**gather),
                     f"{h}.attn.c_attn": ColwiseParallel(output_layouts=Replicate()),
                     f"{h}.attn.c_proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                     f"{h}.mlp": PrepareModuleInput(**gather),
                     f"{h}.mlp.c_fc": ColwiseParallel(), f"{h}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model, tp_mesh, plan)
    model.transformer.wte.weight = model.lm_head.weight
