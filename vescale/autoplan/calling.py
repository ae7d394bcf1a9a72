"""Calling an unmodified model on a sample batch, as ``vescale.parallelize``'s model is
called, and the batch's size and slices: what every planner measurement starts from."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ..parallel.pipeline.engine import loss_in

__all__ = ["call_model", "loss_of", "batch_size_of", "slice_batch", "without_cache"]


def call_model(model: nn.Module, batch):
    """The model called on a batch as vescale.parallelize's model calls it."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_of(output, loss_fn=None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    loss = loss_in(output)
    if loss is None:
        raise TypeError(f"the model returned {type(output).__name__}, not a loss: give a sample batch with labels "
                        f"(e.g. targets / labels) or loss_fn=output -> scalar loss")
    if loss.dim() != 0:
        raise ValueError(f"the planner trains on the model's loss, a scalar; got shape {tuple(loss.shape)}")
    return loss


def batch_size_of(batch) -> int:
    sizes = [x.shape[0] for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not sizes:
        raise ValueError("the sample batch holds no tensor with a batch dim (dim 0); give e.g. (input_ids, targets)")
    return sizes[0]


def slice_batch(batch, n: int):
    """The first ``n`` samples of every tensor with the batch's dim 0."""
    full = batch_size_of(batch)
    return tree_map(lambda x: x[:n] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == full else x,
                    batch)

_CACHE_KWARGS = {"past_key_values", "past_key_value", "layer_past", "use_cache"}


def without_cache(args, kwargs):
    """A module's captured arguments without a KV cache (Hugging Face's default forward
    keeps one: reused, it would chain one call's graph to the next)."""
    args = [None if type(v).__name__.endswith("Cache") else v for v in args]
    kwargs = {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}
    for k in _CACHE_KWARGS & set(kwargs):
        kwargs[k] = False if k == "use_cache" else None
    return args, kwargs
