"""The ops a chain is drawn from: common training ops, in-place and view ops included.

Each entry reads like a table row: a name, how to draw its arguments from the values a
chain holds so far (draws.py), and what it computes. ``run(*tensors, **params)`` uses
only the public torch API, so the same call runs on plain tensors and on DTensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .autograd_ops import (custom_function, grad_penalty, hooked, no_grad_add_, recomputed_block, recomputed_linear,
                           retained_grad)
from .draws import (attention_draw, checkpoint_draw, binary, cat_draw, conv_draw, cross_entropy_draw, diagonal_draw, even_dim,
                     last_dim_index_draw, last_even_fresh, poison_draw, pool_draw, with_dim_fresh,
                     dropout_draw, expanding, fresh_same, group_norm_draw, index_draw, inplace,
                     matmul_draw, narrowing, new_dim, pad_draw, permuting, random_draw,
                     relayout_draw, repeats_draw, reshaping, scalar_draw, selecting, setitem_draw,
                     sizes_draw, two_dims, unary, unfold_draw, unit_dim, with_dim, with_dim_keepdim,
                     with_dim_shift, with_offset)


@dataclass(frozen=True)
class Op:
    name: str
    draw: Callable
    run: Callable
    weight: float = 1.0


# ---- running: fresh tensors come through a factory the interpreter supplies -------------------

def _matmul(x, *, n, seed, fresh, new):
    w = new("weight", (x.shape[-1], n), seed)
    return x @ w


def _linear(x, *, n, seed, fresh, new):
    w = new("weight", (n, x.shape[-1]), seed)
    b = new("weight", (n,), seed + 1)
    return F.linear(x, w, b)


def _layer_norm(x, *, n, seed, fresh, new):
    shape = x.shape[-1:]
    return F.layer_norm(x, shape, new("weight", shape, seed), new("weight", shape, seed + 1))


def _rms_norm(x, *, n, seed, fresh, new):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * new("weight", x.shape[-1:], seed)


def _index_select(x, *, dim, n, seed, fresh, new):
    return x.index_select(dim, new("index", (n,), seed, high=x.shape[dim]))


def _gather(x, *, dim, n, seed, fresh, new):
    shape = list(x.shape)
    shape[dim] = n
    return x.gather(dim, new("index", tuple(shape), seed, high=x.shape[dim]))


def _embedding(x, *, dim, n, seed, fresh, new):
    if x.dim() != 2:
        raise ValueError("embedding takes a 2-d table")
    return F.embedding(new("index", (2, n), seed, high=x.shape[0]), x)


def _attention(kv, *, causal, seed, fresh, new):
    return F.scaled_dot_product_attention(new("weight", tuple(kv.shape), seed), kv, kv, is_causal=causal)


def _mul_fresh(x, *, seed, fresh, new):
    return x * new("weight", tuple(x.shape), seed)


def _copy_fresh(x, *, seed, fresh, new):
    return x.copy_(new("weight", tuple(x.shape), seed))


def _where_fresh(x, *, seed, fresh, new):
    return torch.where(x > 0, x, new("weight", tuple(x.shape), seed))


def _cross_entropy(x, *, seed, fresh, new):
    return F.cross_entropy(x, new("index", (x.shape[0],), seed, high=x.shape[1]))


def _dropout(x, *, p, seed):
    torch.manual_seed(seed)  # every rank and the reference draw from the same state
    return F.dropout(x, p, training=True)


def _setitem(x, *, dim, start, length, s):
    index = (slice(None),) * dim + (slice(start, start + length),)
    x[index] = s
    return x


def _topk_values(x, *, dim):
    return x.topk(min(2, x.shape[dim]), dim).values


def _redistribute(x, *, seed):
    """To placements drawn from the seed (Partial included), asynchronously for odd seeds
    (the next op is then the first use that waits); the identity on plain tensors."""
    if not hasattr(x, "redistribute") or not hasattr(x, "device_mesh"):
        return x.clone()
    from .chains import MESHES, placements_from_codes, fresh_placements
    mesh = x.device_mesh
    name = next(n for n, shape in MESHES.items() if shape == tuple(mesh.shape))
    codes = fresh_placements(seed, list(x.shape), name, partial=True)
    y = x.redistribute(mesh, placements_from_codes(codes), async_op=bool(seed & 1))
    return y.clone() if y is x else y  # to its own placements, redistribute hands back x itself


def _einsum_dot(x, *, seed, fresh, new):
    """A contraction of the last dim with a fresh operand (a sharded last dim gives a Partial)."""
    return torch.einsum("...i,...i->...", x, new("weight", tuple(x.shape), seed))


def _bmm(x, *, n, seed, fresh, new):
    if x.dim() != 3:
        raise ValueError("bmm takes a 3-d value")
    return torch.bmm(x, new("weight", (x.shape[0], x.shape[2], n), seed))


def _addmm(x, *, n, seed, fresh, new):
    if x.dim() != 2:
        raise ValueError("addmm takes a 2-d value")
    return torch.addmm(new("weight", (n,), seed + 1), x, new("weight", (x.shape[1], n), seed), beta=0.5)


def _scatter_add(x, *, dim, n, seed, fresh, new):
    shape = list(x.shape)
    shape[dim] = n
    return x.scatter_add(dim, new("index", tuple(shape), seed, high=x.shape[dim]), new("weight", tuple(shape), seed + 1))


def _index_add(x, *, dim, n, seed, fresh, new):
    shape = list(x.shape)
    shape[dim] = n
    return x.index_add(dim, new("index", (n,), seed, high=x.shape[dim]), new("weight", tuple(shape), seed + 1), alpha=2.0)


def _index_put_accumulate_(x, *, dim, n, seed, fresh, new):
    """``x[idx] += values`` along dim 0, repeated indices summed (an embedding's backward)."""
    idx = new("index", (n,), seed, high=x.shape[0])
    return x.index_put_((idx,), new("weight", (n, *x.shape[1:]), seed + 1), accumulate=True)


def _index_fill_(x, *, dim, n, seed, fresh, new):
    return x.index_fill_(dim, new("index", (n,), seed, high=x.shape[dim]), -1.25)


def _mse_loss(x, *, seed, fresh, new):
    return F.mse_loss(x, new("weight", tuple(x.shape), seed))


def _group_norm(x, *, groups, seed, fresh, new):
    c = x.shape[1]
    return F.group_norm(x, groups, new("weight", (c,), seed), new("weight", (c,), seed + 1))


def _randn_like(x, *, seed):
    torch.manual_seed(seed)  # the same state on every rank and in the reference
    return x * torch.randn_like(x)


def _normal_(x, *, seed):
    torch.manual_seed(seed)
    return x.normal_(0.0, 0.02)


def _trunc_normal_(x, *, seed):
    """torchtitan's weight init, in place on a (possibly sharded) tensor."""
    torch.manual_seed(seed)
    return torch.nn.init.trunc_normal_(x, std=0.02, a=-0.04, b=0.04)


def _cosine_similarity(x, *, seed, fresh, new):
    return F.cosine_similarity(x, new("weight", tuple(x.shape), seed), dim=-1)


def _bce_with_logits(x, *, seed, fresh, new):
    return F.binary_cross_entropy_with_logits(x, torch.sigmoid(new("weight", tuple(x.shape), seed)))


def _kl_div(x, *, seed, fresh, new):
    return F.kl_div(x.log_softmax(-1), new("weight", tuple(x.shape), seed).softmax(-1), reduction="batchmean")


def _smooth_l1(x, *, seed, fresh, new):
    return F.smooth_l1_loss(x, new("weight", tuple(x.shape), seed), beta=0.5)


def _conv1d(x, *, n, k, pad, seed, fresh, new):
    return F.conv1d(x, new("weight", (n, x.shape[1], k), seed), new("weight", (n,), seed + 1), padding=pad)


def _batch_norm(x, *, seed, fresh, new):
    c = x.shape[1]
    y = F.batch_norm(x, None, None, new("weight", (c,), seed), new("weight", (c,), seed + 1), training=True)
    if y.requires_grad:
        # torch 2.13's CPU batch-norm backward misreads a channels-last gradient whose
        # size-1 dims have other strides, on plain tensors too (docs/fuzzing.md): the
        # gradient is made contiguous on both sides
        y.register_hook(lambda g: g.contiguous())
    return y


def _one_hot_add(x, *, seed, fresh, new):
    """x plus a one-hot of a fresh index over its last dim (labels smoothed into logits)."""
    idx = new("index", tuple(x.shape[:-1]), seed, high=x.shape[-1])
    return x + F.one_hot(idx, x.shape[-1]).to(x.dtype)


def _multinomial_gather(x, *, seed):
    """Sample one column per row from softmax(x), then read the sampled logits (a policy's
    log-probabilities of its own samples): the index comes from the data and the RNG."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError("a 2-d value with columns")
    torch.manual_seed(seed)
    return x.gather(1, torch.multinomial(x.softmax(1), 1))


def _checkpoint_reshard(x, *, seed):
    """vescale.save of the value, then vescale.load into a fresh tensor of placements drawn
    from the seed (Partial included: a load must overwrite it whole): resharding through
    a checkpoint. A contiguous copy on plain tensors (the target is laid out so); no
    gradient flows through a checkpoint."""
    if not hasattr(x, "redistribute") or not hasattr(x, "device_mesh"):
        return x.detach().clone(memory_format=torch.contiguous_format)
    import os
    import vescale
    from .chains import MESHES, placements_from_codes, fresh_placements
    mesh = x.device_mesh
    name = next(n for n, shape in MESHES.items() if shape == tuple(mesh.shape))
    codes = fresh_placements(seed, list(x.shape), name, partial=True)
    target = vescale.distribute_tensor(torch.full(tuple(x.shape), 7.0, dtype=x.dtype), mesh,
                                       placements_from_codes(codes))
    # the ranks share the parent's pid; a step's seed and shape name its checkpoint
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vescale_fuzz_ckpt_{os.getppid()}",
                        f"{seed}_{'x'.join(map(str, x.shape))}")
    vescale.save(path, {"x": x.detach()})
    vescale.load(path, {"x": target}, rng=False)
    return target


class _DataAlias(torch.autograd.Function):
    """The plain-tensor meaning of a to_local/from_local round trip: the result shares x's
    data (a write to either shows in the other) but is no autograd view of x, so an
    in-place op on one does not rebase the other's gradient path. That is the documented
    semantics of the round trip (torch's DTensor has it too, docs/fuzzing.md); modelling
    it here checks it exactly instead of reporting it as a wrong result."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad


def _local_round_trip(x, *, seed):
    """to_local then from_local with the same placements: shares x's data, with gradients."""
    if not hasattr(x, "to_local") or not hasattr(x, "device_mesh"):
        return _DataAlias.apply(x)
    import vescale
    return vescale.DTensor.from_local(x.to_local(), x.device_mesh, x.placements, shape=x.shape, stride=x.stride())


# ---- the fourth table: other dtypes inside a step ----------------------------------------------
# Values come back as the chain's float64. Clamping and rounding to multiples of 1/64
# first makes every cast and every sum below exact, so a shard's result must equal one
# device's bit for bit (and no NaN or out-of-range value reaches an integer cast, whose
# result C++ leaves undefined); rounding is nonlinear, so a Partial input is reduced
# before the cast.

def _rope(x, *, seed, fresh, new):
    """Rotary embedding as torchtitan's Llama applies it: pairs of the last dim as complex
    numbers, multiplied by unit complex numbers (torch.polar of fresh angles)."""
    angles = new("weight", (x.shape[-1] // 2,), seed)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def _rfft_filter(x, *, dim, seed, fresh, new):
    """A filter in frequency space: rfft along `dim`, scaled per frequency, irfft back."""
    dim = dim % x.dim()
    n = x.shape[dim]
    w = new("weight", (n // 2 + 1,) + (1,) * (x.dim() - 1 - dim), seed)
    return torch.fft.irfft(torch.fft.rfft(x, dim=dim) * w, n=n, dim=dim)


def _complex_math(x, *, seed, fresh, new):
    z = torch.complex(x, new("weight", tuple(x.shape), seed))
    return (z * z.conj()).real + torch.angle(z) + (z.exp() / (z.abs() + 1)).imag


def _normal_tensor(x, *, seed):
    torch.manual_seed(seed)
    return torch.normal(x, x.abs() + 0.1)


def _poisson_add(x, *, seed):
    torch.manual_seed(seed)
    return torch.poisson(x.abs()) + x


# ---- non-finite values: a diverged activation, an attention mask's -inf --------------------
# Written where x's own values are extreme, so the positions are the same on one device
# and in every shard. NaN and +-inf must reach the same places a sharded run computes as
# one device's: a NaN a cross-rank max drops, or an all -inf block a split softmax turns
# into NaN, is a wrong answer that looks like a number (or hides a divergence).

def _poisoned(x, *, kind):
    if kind == "nan":
        return x.masked_fill(x > 1.2, float("nan"))
    if kind == "inf":
        return x.masked_fill(x > 1.2, float("inf")).masked_fill(x < -1.2, float("-inf"))
    return x.masked_fill(x < -0.6, float("-inf"))  # "mask": the -inf of a causal / padding mask


def _poison_(x, *, kind):
    high, low = x > (-0.6 if kind == "mask" else 1.2), x < (-0.6 if kind == "mask" else -1.2)
    if kind == "nan":
        return x.masked_fill_(high, float("nan"))
    if kind == "inf":
        return x.masked_fill_(high, float("inf")).masked_fill_(low, float("-inf"))
    return x.masked_fill_(low, float("-inf"))


def _masked_softmax(x, *, dim, log):
    """Softmax over a dim some of whose entries are masked to -inf (whole rows too)."""
    masked = x.masked_fill(x < -0.6, float("-inf"))
    return F.log_softmax(masked, dim) if log else F.softmax(masked, dim)

def _grid(x, bound=100.0):
    return torch.round(torch.nan_to_num(x, 0.0).clamp(-bound, bound) * 64) / 64


def _ints(x):
    return (_grid(x, 1e5) * 8).long()


def _float32_matmul(x, *, n, seed, fresh, new):
    w = new("weight", (x.shape[-1], n), seed)
    return (_grid(x, 4.0).float() @ _grid(w, 4.0).float()).to(x.dtype)


def _copy_from_float32_(a, b):
    return a.copy_(_grid(b).float())


def _int_inplace(x):
    t = _ints(x)
    t.add_(3).mul_(-2).clamp_(-9, 9)
    return t.to(x.dtype)


OPS: list[Op] = [
    # pointwise
    Op("neg", unary, lambda x: -x),
    Op("exp", unary, lambda x: torch.exp(x.clamp(max=5))),
    Op("tanh", unary, torch.tanh),
    Op("sigmoid", unary, torch.sigmoid),
    Op("relu", unary, F.relu),
    Op("gelu", unary, F.gelu),
    Op("silu", unary, F.silu),
    Op("abs", unary, torch.abs),
    Op("square", unary, lambda x: x * x),
    Op("rsqrt", unary, lambda x: torch.rsqrt(x.abs() + 1)),
    Op("clamp", unary, lambda x: x.clamp(-0.5, 0.7)),
    Op("add_scalar", scalar_draw, lambda x, s: x + s),
    Op("mul_scalar", scalar_draw, lambda x, s: x * s),
    Op("pow", unary, lambda x: x.pow(2)),
    Op("add", binary, torch.add, 2),
    Op("sub", binary, torch.sub),
    Op("mul", binary, torch.mul, 2),
    Op("div", binary, lambda a, b: a / (b.abs() + 0.5)),
    Op("maximum", binary, torch.maximum),
    Op("where", binary, lambda a, b: torch.where(a > b, a, b)),
    Op("mul_fresh", fresh_same, _mul_fresh),
    Op("where_fresh", fresh_same, _where_fresh),
    Op("masked_fill", unary, lambda x: x.masked_fill(x > 0.3, 0.0)),
    Op("float_to_int_to_float", unary, lambda x: (x * 4).long().to(x.dtype)),
    # in-place
    Op("add_", inplace(binary), lambda a, b: a.add_(b), 2),
    Op("mul_", inplace(binary), lambda a, b: a.mul_(b)),
    Op("mul_scalar_", inplace(scalar_draw), lambda x, s: x.mul_(s)),
    Op("relu_", inplace(unary), lambda x: F.relu(x, inplace=True)),
    Op("clamp_", inplace(unary), lambda x: x.clamp_(-0.5, 0.7)),
    Op("neg_", inplace(unary), lambda x: x.neg_()),
    Op("zero_", inplace(unary), lambda x: x.zero_(), 0.3),
    Op("copy_", inplace(fresh_same), _copy_fresh),
    Op("masked_fill_", inplace(unary), lambda x: x.masked_fill_(x > 0.3, 0.0)),
    Op("setitem", inplace(setitem_draw), _setitem),
    Op("addcmul_", inplace(binary), lambda a, b: a.addcmul_(b, b, value=0.5)),
    # views
    Op("view_flat", unary, lambda x: x.reshape(-1)),
    Op("reshape", reshaping, lambda x, shape: x.reshape(shape), 2),
    Op("view", reshaping, lambda x, shape: x.view(shape)),
    Op("transpose", two_dims, lambda x, d0, d1: x.transpose(d0, d1), 2),
    Op("permute", permuting, lambda x, perm: x.permute(perm)),
    Op("t", two_dims, lambda x, d0, d1: x.t()),
    Op("unsqueeze", new_dim, lambda x, dim: x.unsqueeze(dim)),
    Op("squeeze_dim", unit_dim, lambda x, dim: x.squeeze(dim)),
    Op("squeeze", unary, torch.squeeze),
    Op("narrow", narrowing, lambda x, dim, start, length: x.narrow(dim, start, length), 2),
    Op("select", selecting, lambda x, dim, index: x.select(dim, index)),
    Op("step_slice", with_dim, lambda x, dim: x[(slice(None),) * (dim % x.dim()) + (slice(None, None, 2),)]),
    Op("expand", expanding, lambda x, lead: x.unsqueeze(0).expand(lead, *x.shape)),
    Op("unbind", with_dim, lambda x, dim: x.unbind(dim)[0]),
    Op("split", with_dim, lambda x, dim: x.split(2, dim)[-1]),
    Op("chunk", with_dim, lambda x, dim: x.chunk(3, dim)[0]),
    Op("contiguous", unary, lambda x: x.contiguous()),
    Op("clone", unary, torch.clone, 2),
    Op("flatten", unary, lambda x: x.flatten(1) if x.dim() > 1 else x.flatten()),
    Op("movedim", two_dims, lambda x, d0, d1: x.movedim(d0, d1)),
    # in-place views
    Op("transpose_", inplace(two_dims), lambda x, d0, d1: x.transpose_(d0, d1)),
    Op("t_", inplace(two_dims), lambda x, d0, d1: x.t_()),
    Op("swapdims_", inplace(two_dims), lambda x, d0, d1: x.swapdims_(d0, d1)),
    Op("squeeze_", inplace(unit_dim), lambda x, dim: x.squeeze_(dim)),
    Op("unsqueeze_", inplace(new_dim), lambda x, dim: x.unsqueeze_(dim)),
    # reductions
    Op("sum_all", unary, torch.sum),
    Op("sum", with_dim_keepdim, lambda x, dim, keepdim: x.sum(dim, keepdim=keepdim), 2),
    Op("mean", with_dim_keepdim, lambda x, dim, keepdim: x.mean(dim, keepdim=keepdim)),
    Op("amax", with_dim_keepdim, lambda x, dim, keepdim: x.amax(dim, keepdim=keepdim)),
    Op("amin", with_dim_keepdim, lambda x, dim, keepdim: x.amin(dim, keepdim=keepdim)),
    Op("max_dim", with_dim_keepdim, lambda x, dim, keepdim: x.max(dim, keepdim=keepdim).values),
    Op("min_dim", with_dim_keepdim, lambda x, dim, keepdim: x.min(dim, keepdim=keepdim).values),
    Op("argmax", with_dim, lambda x, dim: x.argmax(dim).to(x.dtype)),
    Op("norm", with_dim, lambda x, dim: x.norm(dim=dim)),
    Op("var", with_dim, lambda x, dim: x.var(dim)),
    Op("logsumexp", with_dim, lambda x, dim: x.logsumexp(dim)),
    Op("softmax", with_dim, lambda x, dim: x.softmax(dim), 2),
    Op("log_softmax", with_dim, lambda x, dim: x.log_softmax(dim)),
    Op("cumsum", with_dim, lambda x, dim: x.cumsum(dim)),
    Op("topk", with_dim, _topk_values),
    Op("sort", with_dim, lambda x, dim: x.sort(dim).values),
    # matmul family, norms, indexing, losses, randomness
    Op("matmul", matmul_draw, _matmul, 3),
    Op("linear", matmul_draw, _linear, 2),
    Op("layer_norm", matmul_draw, _layer_norm),
    Op("rms_norm", matmul_draw, _rms_norm),
    Op("cat", cat_draw, lambda a, b, dim: torch.cat([a, b], dim)),
    Op("stack", binary, lambda a, b: torch.stack([a, a * b])),
    Op("index_select", index_draw, _index_select),
    Op("gather", index_draw, _gather),
    Op("embedding", index_draw, _embedding),
    Op("attention", attention_draw, _attention, 2),
    Op("cross_entropy", cross_entropy_draw, _cross_entropy),
    Op("dropout", dropout_draw, _dropout),
    # the DTensor API inside a chain (identities on plain tensors)
    Op("redistribute", relayout_draw, _redistribute, 2),
    Op("local_round_trip", relayout_draw, _local_round_trip),
    Op("checkpoint_reshard", relayout_draw, _checkpoint_reshard, 0.5),

    # the second table: what real models and optimizers add (masks, shifts, repeats,
    # scatters, pads, contractions, random fills and in-place optimizer updates)
    Op("sin", unary, torch.sin),
    Op("cos", unary, torch.cos),
    Op("log1p_abs", unary, lambda x: torch.log1p(x.abs())),
    Op("sqrt_abs", unary, lambda x: (x.abs() + 0.1).sqrt()),
    Op("softplus", unary, F.softplus),
    Op("leaky_relu", unary, lambda x: F.leaky_relu(x, 0.1)),
    Op("clamp_tensor", binary, lambda a, b: torch.clamp(a, min=b)),
    Op("full_like", unary, lambda x: x + torch.full_like(x, 0.5)),
    Op("flip", with_dim, lambda x, dim: x.flip(dim)),
    Op("roll", with_dim_shift, lambda x, dim, shift: x.roll(shift, dim)),
    Op("tril", with_offset, lambda x, k: x.tril(k)),
    Op("triu", with_offset, lambda x, k: x.triu(k)),
    Op("diagonal", diagonal_draw, lambda x, d0, d1, offset: x.diagonal(offset, d0, d1)),
    Op("repeat", repeats_draw, lambda x, reps: x.repeat(*reps)),
    Op("repeat_interleave", with_dim, lambda x, dim: x.repeat_interleave(2, dim)),
    Op("pad", pad_draw, lambda x, pad, value: F.pad(x, pad, value=value)),
    Op("split_sizes", sizes_draw, lambda x, dim, sizes, part: x.split(list(sizes), dim)[part]),
    Op("tensor_split", with_dim, lambda x, dim: x.tensor_split(3, dim)[1]),
    Op("unfold", unfold_draw, lambda x, dim, size, step: x.unfold(dim, size, step)),
    Op("prod", with_dim, lambda x, dim: x.prod(dim)),
    Op("cumprod", with_dim, lambda x, dim: x.cumprod(dim)),
    Op("cummax", with_dim, lambda x, dim: x.cummax(dim).values),
    Op("logcumsumexp", with_dim, lambda x, dim: x.logcumsumexp(dim)),
    Op("std", with_dim_keepdim, lambda x, dim, keepdim: x.std(dim, keepdim=keepdim)),
    # contiguous first: torch 2.13's CPU median(dim) over a dim of stride 0 (an expanded
    # tensor) returns uninitialized values on plain tensors too (docs/fuzzing.md)
    Op("median", with_dim, lambda x, dim: x.contiguous().median(dim).values),
    Op("argmin", with_dim, lambda x, dim: x.argmin(dim).to(x.dtype)),
    Op("any", with_dim, lambda x, dim: (x > 0.5).any(dim).to(x.dtype)),
    Op("max_all", unary, torch.max),
    Op("mean_all", unary, torch.mean),
    Op("einsum_dot", fresh_same, _einsum_dot),
    Op("bmm", matmul_draw, _bmm),
    Op("addmm", matmul_draw, _addmm),
    Op("scatter_add", index_draw, _scatter_add),
    Op("index_add", index_draw, _index_add),
    Op("mse_loss", fresh_same, _mse_loss),
    Op("group_norm", group_norm_draw, _group_norm),
    Op("randn_like", random_draw, _randn_like),
    Op("index_put_acc_", inplace(index_draw), _index_put_accumulate_),
    Op("index_fill_", inplace(index_draw), _index_fill_),
    Op("sub_", inplace(binary), lambda a, b: a.sub_(b)),
    Op("div_", inplace(binary), lambda a, b: a.div_(b.abs() + 0.5)),
    Op("lerp_", inplace(binary), lambda a, b: a.lerp_(b, 0.1)),
    Op("addcdiv_", inplace(binary), lambda a, b: a.addcdiv_(b, b.abs() + 1, value=-0.1)),
    Op("clamp_min_", inplace(unary), lambda x: x.clamp_min_(-0.3)),
    Op("normal_", inplace(random_draw), _normal_, 0.5),
    Op("trunc_normal_", inplace(random_draw), _trunc_normal_, 0.5),
    # the third table: losses, convolutions, pools, normalizations and indices read from
    # the data itself (argmax / argsort / samples feeding gather, scatter, take_along_dim)
    Op("normalize", with_dim, lambda x, dim: F.normalize(x, dim=dim)),
    Op("cosine_similarity", fresh_same, _cosine_similarity),
    Op("bce_with_logits", fresh_same, _bce_with_logits),
    Op("kl_div", fresh_same, _kl_div),
    Op("smooth_l1", fresh_same, _smooth_l1),
    Op("glu", even_dim, lambda x, dim: F.glu(x, dim)),
    Op("logaddexp", binary, torch.logaddexp),
    Op("atan2", binary, torch.atan2),
    Op("pow_tensor", binary, lambda a, b: (a.abs() + 0.5).pow(b.clamp(-2, 2))),
    Op("sign_round", unary, lambda x: torch.sign(x) * torch.round(x * 2)),
    Op("where_scalar", unary, lambda x: torch.where(x > 0.2, x, 0.0)),
    Op("conv1d", conv_draw, _conv1d),
    Op("avg_pool1d", pool_draw, lambda x, k, stride: F.avg_pool1d(x, k, stride)),
    Op("max_pool1d", pool_draw, lambda x, k, stride: F.max_pool1d(x, k, stride)),
    Op("interpolate", pool_draw, lambda x, k, stride: F.interpolate(x, scale_factor=k, mode="linear" if stride == 2
                                                                     else "nearest")),
    Op("batch_norm", group_norm_draw, lambda x, groups, seed, fresh, new: _batch_norm(x, seed=seed, fresh=fresh,
                                                                                      new=new)),
    Op("one_hot_add", last_dim_index_draw, _one_hot_add),
    Op("gather_argmax", with_dim, lambda x, dim: x.gather(dim, x.argmax(dim, keepdim=True))),
    Op("take_along_argsort", with_dim, lambda x, dim: x.take_along_dim(x.argsort(dim), dim)),
    Op("scatter_at_argmax", with_dim, lambda x, dim: x.scatter(dim, x.argmax(dim, keepdim=True), 0.0)),
    Op("multinomial_gather", random_draw, _multinomial_gather, 0.5),
    # the fourth table: float32, bfloat16, integer and bool values inside a step
    Op("float32_math", unary, lambda x: (_grid(x).float() * 1.5 - 0.25).to(x.dtype)),
    Op("bfloat16_math", unary, lambda x: (_grid(x.clamp(-2, 2)).bfloat16() * 2 + 1).to(x.dtype)),
    Op("float32_sum", with_dim, lambda x, dim: _grid(x).float().sum(dim).to(x.dtype)),
    Op("float32_matmul", matmul_draw, _float32_matmul),
    Op("promote_float32", unary, lambda x: _grid(x).float() + x),
    Op("copy_from_float32_", inplace(binary), _copy_from_float32_),
    Op("int_floor_divide", unary, lambda x: torch.div(_ints(x), 3, rounding_mode="floor").to(x.dtype)),
    Op("int_remainder", unary, lambda x: (_ints(x) % 5).to(x.dtype)),
    Op("int_bitwise", unary, lambda x: ((_ints(x) & 7) | (_ints(x) << 1) ^ 5).to(x.dtype)),
    Op("int_sum", with_dim, lambda x, dim: _ints(x).sum(dim).to(x.dtype)),
    Op("int_cumsum", with_dim, lambda x, dim: _ints(x).cumsum(dim).to(x.dtype)),
    Op("int_amax", with_dim, lambda x, dim: _ints(x).amax(dim).to(x.dtype)),
    # narrower integers: an empty shard's block of a max/min is filled with the dtype's own
    # extreme (int64's did not fit, and only the ranks with empty shards raised)
    Op("int32_amin", with_dim, lambda x, dim: _ints(x).int().amin(dim).to(x.dtype)),
    Op("int8_amax", with_dim, lambda x, dim: (_ints(x) % 201 - 100).to(torch.int8).amax(dim).to(x.dtype)),
    Op("uint8_min_dim", with_dim, lambda x, dim: (_ints(x) % 256).to(torch.uint8).min(dim).values.to(x.dtype)),
    Op("int_sort", with_dim, lambda x, dim: _ints(x).sort(stable=True, dim=dim).values.to(x.dtype)),
    Op("int_inplace", unary, _int_inplace),
    Op("bool_count", with_dim, lambda x, dim: (x > 0).sum(dim).to(x.dtype)),
    Op("bool_logic", unary, lambda x: ((x > 0) ^ (x.abs() < 0.5) | (x > 1)).to(x.dtype)),
    Op("bool_where", binary, lambda a, b: torch.where((a > 0) & (b < 0.3), a, b)),
    Op("bool_roundtrip", unary, lambda x: x.bool().to(x.dtype) + x),
    Op("int_gather", with_dim, lambda x, dim: x.gather(dim, _ints(x).abs() % x.shape[dim])),
    # the fifth table: complex values inside a step, and ops whose CPU layout the meta kernel missed
    Op("rope", last_even_fresh, _rope),
    Op("rfft_filter", with_dim_fresh, _rfft_filter),
    Op("fft_abs", with_dim, lambda x, dim: torch.fft.fft(x, dim=dim).abs()),
    Op("complex_math", fresh_same, _complex_math),
    Op("isin_add", unary, lambda x: torch.isin(_grid(x), _grid(x).flatten()[:3]).to(x.dtype) + x),
    Op("normal_tensor", random_draw, _normal_tensor),
    Op("poisson_add", random_draw, _poisson_add),
    # the sixth table: autograd itself (activation checkpointing, custom Functions, hooks,
    # detach, double backward, updates under no_grad; autograd_ops.py)
    Op("checkpoint_dropout", checkpoint_draw, recomputed_block),
    Op("checkpoint_linear", matmul_draw, recomputed_linear),
    Op("autograd_function", fresh_same, custom_function),
    Op("grad_hook", unary, hooked),
    Op("detach_add", binary, lambda a, b: a + b.detach().sin()),
    Op("grad_penalty", unary, grad_penalty, 0.5),
    Op("no_grad_add_", fresh_same, no_grad_add_, 0.5),
    Op("retain_graph", unary, retained_grad, 0.5),
    # the seventh table: non-finite values (the generator keeps them only from these ops on,
    # chains.py) and the ops that read them
    Op("poison", poison_draw, _poisoned),
    Op("poison_", inplace(poison_draw), _poison_, 0.5),
    Op("masked_softmax", with_dim, lambda x, dim: _masked_softmax(x, dim=dim, log=False)),
    Op("masked_log_softmax", with_dim, lambda x, dim: _masked_softmax(x, dim=dim, log=True)),
    Op("nan_to_num", unary, lambda x: torch.nan_to_num(x, nan=0.5, posinf=3.0, neginf=-3.0)),
    Op("nansum", with_dim, lambda x, dim: x.nansum(dim)),
    Op("nanmean", with_dim, lambda x, dim: x.nanmean(dim)),
    Op("finite_count", with_dim, lambda x, dim: torch.isfinite(x).sum(dim).to(x.dtype)),
    Op("nan_any", with_dim, lambda x, dim: torch.isnan(x).any(dim).to(x.dtype)),
    Op("fmax", binary, torch.fmax),
    Op("fmin", binary, torch.fmin),
    Op("where_nan", unary, lambda x: torch.where(torch.isnan(x), 0.0, x)),
]

OPS_BY_NAME = {op.name: op for op in OPS}
