"""The sixth table: what training code does to autograd itself, beyond calling ops.

Activation checkpointing (reentrant and not, dropout inside: the recomputed mask must be
the forward's), custom ``torch.autograd.Function``s (a hand-written backward, a
straight-through estimator), gradient hooks that read the whole gradient, ``detach``,
double backward (``autograd.grad`` with ``create_graph``: gradient penalties), a
gradient taken with ``retain_graph`` before the final backward, and in-place updates
under ``no_grad``. Each runs with the public API only, so the same call
runs on plain tensors and on DTensors; where autograd is off (inference mode) each falls
back to the same forward on both sides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def recomputed_block(x, *, p, seed, reentrant):
    """A block with dropout under activation checkpointing: backward runs it again, and
    checkpoint restores the RNG state so the second mask equals the first."""
    torch.manual_seed(seed)

    def block(t):
        return F.dropout(torch.tanh(t) * t, p, training=True).softmax(-1)

    if reentrant and not (x.requires_grad and torch.is_grad_enabled()):
        return block(x)  # reentrant checkpointing needs an input that requires grad
    return checkpoint(block, x, use_reentrant=reentrant)


def recomputed_linear(x, *, n, seed, fresh, new):
    """gelu(x @ w) under activation checkpointing, the weight an input of the block."""
    w = new("weight", (x.shape[-1], n), seed)
    reentrant = bool(seed & 1) and x.requires_grad and torch.is_grad_enabled()
    return checkpoint(lambda t, u: F.gelu(t @ u), x, w, use_reentrant=reentrant)


class _ScaledTanh(torch.autograd.Function):
    """tanh(x) * w with a hand-written backward that reads saved tensors."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.tanh(x) * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * w * (1 - t * t), grad * t


class _StraightThroughRound(torch.autograd.Function):
    """Quantisation-aware training's estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


def custom_function(x, *, seed, fresh, new):
    return _ScaledTanh.apply(_StraightThroughRound.apply(x), new("weight", tuple(x.shape), seed))


def hooked(x):
    """A hook that rewrites the gradient from all of it (its mean), as clipping hooks do."""
    y = x * 1.5
    if y.requires_grad:
        y.register_hook(lambda g: g * 2 - g.mean())
    return y


def grad_penalty(x):
    """d/dx sum(sin(x) * x), kept differentiable (create_graph), times x: backward then
    runs the backward of a backward."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return torch.cos(x) * x * x + torch.sin(x) * x
    (g,) = torch.autograd.grad((torch.sin(x) * x).sum(), x, create_graph=True)
    return g * x


def retained_grad(x):
    """tanh(x) * x plus its gradient taken with ``retain_graph``: the final backward runs
    through the same graph a second time."""
    y = torch.tanh(x) * x
    if not (x.requires_grad and torch.is_grad_enabled()):
        return y
    (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    return y + g


def no_grad_add_(x, *, seed, fresh, new):
    """An optimizer-style update: in place, outside autograd."""
    with torch.no_grad():
        x.add_(new("weight", tuple(x.shape), seed), alpha=0.1)
    return x
