"""Every op with a sharding rule, under every combination of input placements (a
covering subset when the product is large), on 1-d meshes of 2 and 4 ranks and a
2x2 mesh: forward values and input gradients against the single-device result.

Inputs are float64 so that a wrong placement can't hide in rounding; tolerances
are rtol 1e-7 / atol 1e-9 (reductions run in another order on the shards). Shapes
are chosen so that 4 ranks split some dims unevenly or leave shards empty."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import vescale
from vescale import Replicate

from dist_utils import combos, describe, make_dtensor, mesh, mismatch, placement_options, rand


@dataclass
class Arg:
    shape: tuple
    kind: str = "float"      # float | float32 | positive | nan | index:<n> | target:<n> | ignored
    grad: bool = True

    def make(self, seed: int) -> torch.Tensor:
        if self.kind == "ignored":  # targets that are all ignored: a NaN mean, zero gradients
            return torch.full(self.shape, -100)
        if self.kind.startswith(("index", "target")):
            high = int(self.kind.split(":")[1])
            t = torch.randint(0, high, self.shape, generator=torch.Generator().manual_seed(seed))
            if self.kind.startswith("target") and t.numel() > 2:
                t.view(-1)[1] = -100  # an ignored target
            return t
        t = rand(self.shape, seed)
        if self.kind == "nan":  # one NaN, late in the tensor: in the last ranks' shards
            t.view(-1)[t.numel() * 3 // 4] = float("nan")
        if self.kind == "float32":  # for kernels without float64
            return t.float()
        return t.abs() + 0.5 if self.kind == "positive" else t

    @property
    def differentiable(self) -> bool:
        return self.grad and not self.kind.startswith(("index", "target", "ignored"))


@dataclass
class Case:
    name: str
    fn: Callable
    args: list = field(default_factory=list)
    partial: bool = True  # offer Partial inputs
    rtol: float = 1e-7    # float32 cases: rounding of float32 sums in another order
    atol: float = 1e-9


def _cases() -> list[Case]:
    x56, x6 = Arg((5, 6)), Arg((6,))
    x356 = Arg((3, 5, 6))
    return [
        # pointwise
        Case("relu", torch.relu, [x56]),
        Case("exp", lambda x: torch.exp(0.1 * x), [x56]),
        Case("tanh", torch.tanh, [x356]),
        Case("gelu", F.gelu, [x56]),
        Case("sigmoid", torch.sigmoid, [x56]),
        Case("sqrt", torch.sqrt, [Arg((5, 6), "positive")]),
        Case("neg_scale_shift", lambda x: -x * 2 / 3 + 1, [x56]),
        Case("pow", lambda x: x.pow(2), [x56]),
        Case("add_broadcast", lambda a, b: a + b, [x56, x6]),
        Case("add_alpha", lambda a, b: torch.add(a, b, alpha=0.5), [x56, x56]),
        Case("sub", lambda a, b: a - b, [x356, x56]),
        Case("mul", lambda a, b: a * b, [x56, x56]),
        Case("div", lambda a, b: a / b, [x56, Arg((5, 6), "positive")]),
        Case("maximum", torch.maximum, [x56, x56]),
        Case("where", lambda a, b: torch.where(a > 0, a, b), [x56, x56]),
        # matmul family
        Case("mm", torch.mm, [x56, Arg((6, 4))]),
        Case("addmm", torch.addmm, [Arg((4,)), x56, Arg((6, 4))]),
        Case("bmm", torch.bmm, [x356, Arg((3, 6, 4))]),
        Case("matmul_3d_2d", torch.matmul, [x356, Arg((6, 4))]),
        Case("matmul_4d", torch.matmul, [Arg((2, 3, 5, 6)), Arg((2, 3, 6, 4))]),
        Case("linear", F.linear, [x356, Arg((4, 6)), Arg((4,))]),
        # reductions
        Case("sum_all", torch.sum, [x356]),
        Case("sum_dim", lambda x: x.sum(1), [x356]),
        Case("sum_dims_keepdim", lambda x: x.sum((0, 2), keepdim=True), [x356]),
        Case("mean_all", torch.mean, [x56]),
        Case("mean_dim", lambda x: x.mean(0), [x56]),
        Case("mean_dim_keepdim", lambda x: x.mean(-1, keepdim=True), [x356]),
        Case("amax", lambda x: x.amax(1), [x356]),
        Case("max_all", lambda x: x.max(), [x56]),
        Case("max_dim", lambda x: x.max(1).values, [x56]),
        Case("argmax_gather", lambda x: x.gather(1, x.argmax(1, keepdim=True)), [x56]),
        Case("var_std", lambda x: x.var(0) + x.std(1, keepdim=True).mean(), [x56]),
        Case("logsumexp", lambda x: x.logsumexp(-1), [x356]),
        Case("cumsum", lambda x: x.cumsum(0), [x56]),
        Case("norm2", lambda x: torch.linalg.vector_norm(x, dim=1), [x356]),
        Case("norm1_all", lambda x: torch.linalg.vector_norm(x, ord=1), [x56]),
        Case("norm_inf", lambda x: torch.linalg.vector_norm(x, ord=float("inf"), dim=(0, 2)), [x356]),
        # a NaN in one rank's shard: one device's max, min and inf-norm are NaN (the
        # backends' max and min across ranks once dropped it, by the order ranks met)
        Case("max_min_nan", lambda x: torch.stack([x.max(), x.min()]), [Arg((5, 6), "nan")]),
        Case("amax_amin_nan", lambda x: x.amax(1) + x.amin(1), [Arg((3, 5, 6), "nan")]),
        Case("norm_inf_nan", lambda x: torch.linalg.vector_norm(x, ord=float("inf"), dim=1), [Arg((5, 6), "nan")]),
        Case("any_all", lambda x: (x > 0).any(1).float() + (x > -3).all(0).float().sum(), [x56]),
        # views and shapes
        Case("view_merge", lambda x: x.view(30), [x56]),
        Case("view_split", lambda x: x.view(2, 3, 5), [Arg((6, 5))]),
        Case("view_heads", lambda x: x.view(3, 5, 2, 3).transpose(1, 2), [x356]),
        Case("reshape_copy", lambda x: x.t().reshape(30), [x56]),
        Case("transpose", lambda x: x.transpose(0, 2), [x356]),
        Case("permute", lambda x: x.permute(2, 0, 1), [x356]),
        Case("t", lambda x: x.t(), [x56]),
        Case("flatten_unflatten", lambda x: x.flatten(1).unflatten(1, (3, 10)), [Arg((3, 5, 6))]),
        Case("unsqueeze_squeeze", lambda x: x.unsqueeze(1).squeeze(1), [x56]),
        Case("expand", lambda x: x.expand(3, 5, 6), [Arg((5, 1))]),
        Case("slice_select", lambda x: x[1:4, 2], [x56]),
        Case("split_cat", lambda x: torch.cat(x.split(2, dim=1)[::-1], dim=1), [x56]),
        Case("stack", lambda a, b: torch.stack([a, b], dim=1), [x56, x56]),
        # indexing, sorting, reordering
        Case("gather", lambda x, i: x.gather(1, i), [x56, Arg((5, 3), "index:6")]),
        Case("scatter_add", lambda x, i, s: x.scatter_add(1, i, s), [x56, Arg((5, 6), "index:6"), x56]),
        Case("index_select", lambda x, i: x.index_select(0, i), [x56, Arg((7,), "index:5")]),
        Case("index_select_dim1", lambda x, i: x.index_select(1, i), [x356, Arg((4,), "index:5")]),
        Case("advanced_index", lambda x, i: x[:, i], [x356, Arg((2, 4), "index:5")]),
        Case("index_add", lambda x, i, s: x.index_add(0, i, s), [x56, Arg((3,), "index:5"), Arg((3, 6))]),
        Case("topk", lambda x: x.topk(3, dim=1).values, [x56]),
        Case("sort", lambda x: x.sort(dim=0, descending=True).values, [x356]),
        Case("flip_roll", lambda x: x.flip(1).roll(2, 0), [x56]),
        Case("tril_triu", lambda x: x.tril(1) + x.triu(-1), [x356]),
        Case("repeat", lambda x: x.repeat(2, 1, 3), [x56]),
        Case("one_hot", lambda i: F.one_hot(i, 7).float(), [Arg((3, 5), "index:7")]),
        Case("masked_fill", lambda x: x.masked_fill(x > 0.5, -1.0), [x56]),
        # softmax
        Case("softmax", lambda x: torch.softmax(x, -1), [x356]),
        Case("log_softmax", lambda x: torch.log_softmax(x, 0), [x56]),
        # embedding, norms, losses, attention
        Case("embedding", lambda i, w: F.embedding(i, w), [Arg((3, 5), "index:10"), Arg((10, 6))]),
        Case("layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b), [x356, x6, x6]),
        Case("layer_norm_plain", lambda x: F.layer_norm(x, (6,)), [x56]),
        Case("cross_entropy_mean", F.cross_entropy, [Arg((7, 5)), Arg((7,), "target:5")]),
        Case("cross_entropy_sum", lambda x, t: F.cross_entropy(x, t, reduction="sum"), [Arg((7, 5)), Arg((7,), "target:5")]),
        Case("nll_none", lambda x, t: F.nll_loss(x, t, reduction="none"), [Arg((7, 5)), Arg((7,), "target:5")]),
        # every target ignored: the loss is 0/0 and the gradient 0 on one device (split
        # classes once gave NaN gradients)
        Case("cross_entropy_all_ignored", F.cross_entropy, [Arg((7, 5)), Arg((7,), "ignored")]),
        Case("nll_all_ignored_weighted", lambda x, t, w: F.nll_loss(x, t, weight=w),
             [Arg((7, 5)), Arg((7,), "ignored"), Arg((5,), "positive", grad=False)]),
        # split lookups zero what a rank does not own by selection: a NaN or inf in a row
        # or class nobody reads (a diverged embedding row, a masked vocabulary entry) once
        # came out NaN, as the product 0 x inf
        Case("embedding_unread_rows_nonfinite", lambda i, w: F.embedding(_odd(i), _even_rows(w, float("nan"))),
             [Arg((3, 5), "index:6"), Arg((12, 6))]),
        Case("embedding_inf_gradient", lambda i, w: F.embedding(_odd(i), w).clamp(-9, 9) * _inf_column(w),
             [Arg((3, 5), "index:6"), Arg((12, 6))]),
        Case("cross_entropy_masked_vocab", lambda x, t: F.cross_entropy(_even_rows(x.t(), float("-inf")).t(), _odd(t)),
             [Arg((7, 10)), Arg((7,), "target:5")]),
        Case("nll_weighted", lambda x, t, w: F.nll_loss(x, t, weight=w),
             [Arg((7, 5)), Arg((7,), "target:5"), Arg((5,), "positive", grad=False)]),
        Case("mv", torch.mv, [x56, x6]),
        Case("dot", torch.dot, [x6, x6]),
        Case("group_norm", lambda x, w, b: F.group_norm(x, 3, w, b), [Arg((4, 6, 5)), x6, x6]),
        Case("rms_norm", lambda x, w: F.rms_norm(x, (6,), w), [x356, x6]),
        Case("sdpa_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
             [Arg((2, 4, 6, 8)), Arg((2, 4, 6, 8)), Arg((2, 4, 6, 8)), Arg((1, 4, 6, 6), grad=False)], partial=False),
        Case("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             [Arg((2, 4, 6, 8)), Arg((2, 4, 6, 8)), Arg((2, 4, 6, 8))], partial=False),
        # grouped-query attention both ways: the kernel's own (2 key/value heads, which 4
        # ranks cannot split evenly), and Hugging Face's repeat_kv with a mask (1 head
        # expanded to 4: shards of a stride-0 dim once packed with the wrong last stride)
        Case("sdpa_gqa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             [Arg((2, 4, 6, 8)), Arg((2, 2, 6, 8)), Arg((2, 2, 6, 8))], partial=False),
        Case("sdpa_expanded_kv", lambda q, k, v, m: F.scaled_dot_product_attention(
                 q, k.expand(2, 4, 6, 8), v.expand(2, 4, 6, 8), attn_mask=m),
             [Arg((2, 4, 6, 8)), Arg((2, 1, 6, 8)), Arg((2, 1, 6, 8)), Arg((1, 1, 6, 6), grad=False)], partial=False),
        # grouped matmuls (Hugging Face's MoE experts; float32 only, rows of 16 bytes), the
        # expert histogram and generate's stopping check
        Case("grouped_mm_2d_3d", lambda a, b: torch._grouped_mm(a, b, offs=_offs(2, 2, 5)),
             [Arg((5, 16), "float32"), Arg((3, 16, 16), "float32")], rtol=1e-5, atol=1e-5),
        Case("grouped_mm_2d_2d", lambda a, b: torch._grouped_mm(a, b, offs=_offs(4, 4, 16)),
             [Arg((16, 16), "float32"), Arg((16, 16), "float32")], rtol=1e-5, atol=1e-5),
        Case("grouped_mm_3d_2d", lambda a, b: torch._grouped_mm(a, b, offs=_offs(4, 8, 16)),
             [Arg((3, 16, 16), "float32"), Arg((16, 16), "float32")], rtol=1e-5, atol=1e-5),
        Case("grouped_mm_3d_3d", torch._grouped_mm,
             [Arg((3, 16, 16), "float32"), Arg((3, 16, 16), "float32")], rtol=1e-5, atol=1e-5),
        Case("histc", lambda x: torch.histc(x, bins=4, min=-1, max=1), [Arg((5, 6), grad=False)]),
        Case("histc_data_range", lambda x: torch.histc(x, bins=4), [Arg((5, 6), grad=False)]),
        Case("isin", torch.isin, [Arg((5, 6), "index:6"), Arg((3,), "index:6")]),
        Case("isin_scalar", lambda e: torch.isin(e, 3), [Arg((5, 6), "index:6")]),
    ]


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


# ---- writes through indexing (index_put) with broadcast values, and cat's legacy rule ----
# torch accepts values of fewer dims, unit dims or 0-d in x[idx] = v (nanoGPT's top-k
# sampling, Hugging Face's generate), and cat skips 1-d empty inputs (Hugging Face's KV
# cache starts from torch.tensor([])). Index tensors are fixed plain tensors without
# duplicate positions unless the written values are the same at every position.

def _set(x, index, value):
    y = x.clone()
    y[index] = value
    return y


def _set_by(x, index_of, value):
    """y[index_of(y)] = value: the mask comes from the DTensor itself."""
    y = x.clone()
    y[index_of(y)] = value
    return y


def _top_k_fill(logits):
    """nanoGPT's generate(top_k=3): logits[logits < v[:, [-1]]] = -inf, then softmax."""
    v, _ = torch.topk(logits, 3)
    logits = logits.clone()
    logits[logits < v[:, [-1]]] = -float("Inf")
    return torch.softmax(logits, dim=-1)


def _odd(i):
    """Indices 2i + 1 (ignored targets stay ignored): the even rows are never read."""
    return torch.where(i >= 0, i * 2 + 1, i)


def _even_rows(x, value):
    return x.masked_fill((torch.arange(x.shape[0]) % 2 == 0).unsqueeze(1), value)


def _inf_column(w):
    """A row vector with one inf: the gradient reaching the looked-up rows holds infs. (It
    multiplies the lookup after the clamp has summed a vocab split's Partial lookup: inf
    times a Partial's parts would be inf - inf, or 0 x inf, where one device has inf;
    docs/engine.md.)"""
    return torch.ones(w.shape[1], dtype=w.dtype).index_fill(0, torch.tensor([1]), float("inf"))


def _empty(x):
    return torch.tensor([], dtype=x.dtype)


def _write_cases() -> list[Case]:
    x356, x56, x6 = Arg((3, 5, 6)), Arg((5, 6)), Arg((6,))
    ij = (torch.tensor([0, 2]), slice(None), torch.tensor([1, 5]))  # not adjacent: view (2, 5)
    return [
        Case("setitem_mask_scalar", lambda x: _set_by(x, lambda y: y > 0, 0.0), [x356]),
        Case("setitem_int_scalar", lambda x: _set(x, torch.tensor([0, 2]), 0.5), [x356]),
        Case("setitem_int0d_scalar", lambda x: _set(x, (slice(None), torch.tensor(3)), -1.0), [x356]),
        Case("setitem_row_broadcast", lambda x, v: _set(x, (slice(None), torch.tensor([4, 0, 2])), v), [x356, x6]),
        Case("setitem_unit_dims", lambda x, v: _set(x, torch.tensor([1]), v), [x356, Arg((1, 1, 6))]),
        Case("setitem_full_values", lambda x, v: _set(x, (slice(None), torch.tensor([4, 0])), v), [x356, Arg((3, 2, 6))]),
        Case("setitem_0d_value", lambda x, v: _set(x, torch.tensor([2, 0]), v), [x356, Arg(())]),
        Case("setitem_not_adjacent", lambda x, v: _set(x, ij, v), [x356, Arg((5,))]),
        Case("setitem_not_adjacent_full", lambda x, v: _set(x, ij, v), [x356, Arg((2, 5))]),
        Case("setitem_mask_leading", lambda x: _set_by(x, lambda y: y[..., 0] > 0, 2.0), [x356]),
        Case("setitem_mask_trailing", lambda x: _set_by(x, lambda y: (slice(None), y[0] > 0), 3.0), [x356]),
        Case("top_k_fill", _top_k_fill, [x56]),
        Case("index_put_broadcast", lambda x, v: torch.index_put(x, (torch.tensor([3, 1]),), v), [x56, x6]),
        Case("index_put_accumulate", lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True),
             [x56, Arg((7,), "index:5"), Arg((1, 6))]),
        Case("index_put_accumulate_0d", lambda x, i, v: torch.ops.aten.index_put(x, [None, i], v, True),
             [x356, Arg((4,), "index:5", grad=False), Arg(())]),
        Case("index_put_accumulate_mask", lambda x, v: torch.index_put(x, (x.detach() > 0,), v, accumulate=True),
             [x56, Arg((), grad=False)]),
        Case("index_put_inplace_unit", lambda x, v: x.clone().index_put_((torch.tensor([0, 4]), torch.tensor([5])), v),
             [x56, Arg((1,))]),
        # index, index_select, gather, masked_fill, where with 0-d or broadcast operands
        Case("index_0d_index", lambda x: x[:, torch.tensor(2)], [x356]),
        Case("index_not_adjacent", lambda x: x[ij], [x356]),
        Case("index_select_0d", lambda x, i: x.index_select(1, i), [x356, Arg((), "index:5")]),
        Case("gather_0d", lambda x, i: x.gather(0, i), [Arg(()), Arg((), "index:1")]),
        Case("scatter_0d", lambda x, i, s: x.scatter(0, i, s), [Arg(()), Arg((), "index:1"), Arg(())]),
        # (its gradient for v needs masked_select: see test_data_dependent_indexing_matches)
        Case("masked_fill_0d_value", lambda x, v: x.masked_fill(x.detach() > 0, v), [x56, Arg((), grad=False)]),
        Case("masked_fill_bcast_mask", lambda x, m: x.masked_fill(m > 0, 1.5), [x356, Arg((5, 1), grad=False)]),
        Case("where_scalar", lambda x: torch.where(x > 0, x, 0.0), [x356]),
        Case("where_0d_bcast", lambda x, y, c: torch.where(c > 0, x, y), [x56, Arg(()), Arg((6,), grad=False)]),
        # cat's 1-d empty inputs: first, middle, last; plain or a DTensor; every one empty
        Case("cat_empty_first", lambda x: torch.cat([_empty(x), x], dim=-2), [x356]),
        Case("cat_empty_middle_last", lambda x, y: torch.cat([x, _empty(x), y, _empty(x)], dim=1), [x356, x356]),
        Case("cat_empty_dtensor", lambda x, e: torch.cat([e, x, e], dim=0), [x356, Arg((0,))]),
        Case("cat_empty_dtensor_first", lambda e, x: torch.cat([e, x], dim=-1), [Arg((0,)), x356]),
        Case("cat_all_empty", lambda e, f: torch.cat([e, f], dim=-2), [Arg((0,)), Arg((0,))]),
        Case("cat_empty_dtype", lambda x: torch.cat([_empty(x).float(), x, _empty(x)], dim=2), [x356]),
        Case("stack_empty", lambda e, f: torch.stack([e, f], dim=0), [Arg((0,)), Arg((0,))]),
    ]


CASES = {c.name: c for c in _cases() + _write_cases()}


def _options(arg: Arg, mesh_ndim: int, first: bool, partial: bool):
    if arg.kind.startswith(("index", "target", "ignored")):
        opts = placement_options(len(arg.shape), mesh_ndim, partial=())
    else:
        opts = placement_options(len(arg.shape), mesh_ndim, partial=("sum",) if partial else ())
    return opts if first else opts + ["plain"]


def _case_op(name: str, mesh_name: str):
    """Runs one case for every placement combination; returns the failures."""
    case = CASES[name]
    m = mesh(mesh_name)
    fulls = [a.make(seed=10 + i) for i, a in enumerate(case.args)]
    ref_inputs = [f.clone().requires_grad_(a.differentiable) for f, a in zip(fulls, case.args)]
    ref_out = case.fn(*ref_inputs)
    grad_out = rand(ref_out.shape, seed=99)
    if ref_out.requires_grad:
        (ref_out * grad_out).sum().backward()
    ref_grads = [t.grad for t in ref_inputs]

    failures = []
    vescale.reset_fallback_counts()
    options = [_options(a, m.ndim, i == 0, case.partial) for i, a in enumerate(case.args)]
    for combo in combos(options):
        label = ", ".join("plain" if p == "plain" else describe(p) for p in combo)
        try:
            inputs = []
            for full, arg, p in zip(fulls, case.args, combo):
                if p == "plain":
                    inputs.append(full.clone())
                else:
                    inputs.append(make_dtensor(full, m, p, seed=3, requires_grad=arg.differentiable))
            out = case.fn(*inputs)
            err = mismatch(out.full_tensor(), ref_out.detach(), rtol=case.rtol, atol=case.atol)
            if err:
                failures.append(f"{label}: forward {err}")
                continue
            if not out.requires_grad:  # every differentiable input was plain
                continue
            g = make_dtensor(grad_out, m, [Replicate()] * m.ndim)
            (out * g).sum().backward()
            for k, (t, arg, p) in enumerate(zip(inputs, case.args, combo)):
                if p == "plain" or not arg.differentiable:
                    continue
                if t.grad is None:
                    failures.append(f"{label}: no grad for input {k}")
                    continue
                err = mismatch(t.grad.full_tensor(), ref_grads[k], rtol=case.rtol, atol=case.atol)
                if err:
                    failures.append(f"{label}: grad of input {k} {err}")
                want = [Replicate() if q.is_partial() else q for q in p]
                if list(t.grad.placements) != want:
                    failures.append(f"{label}: grad of input {k} placed {t.grad.placements}, expected {want}")
        except Exception as e:
            # Ranks may now be out of step (one raised, others wait in a collective):
            # stop here and report rather than run on.
            raise AssertionError(f"{name} with inputs {label} raised") from e
    # Every op these cases dispatch, forward and backward, must have a real rule.
    fallbacks = vescale.fallback_counts()
    if fallbacks:
        failures.append(f"ops that went through the replicate fallback: {fallbacks}")
    return failures


@pytest.mark.parametrize("name", list(CASES))
def test_op_1d_2ranks(pool2, name):
    assert pool2.run(_case_op, name, "1d2")[0] == []


@pytest.mark.parametrize("name", list(CASES))
def test_op_1d_4ranks(pool4, name):
    assert pool4.run(_case_op, name, "1d4")[0] == []


@pytest.mark.parametrize("name", list(CASES))
def test_op_2d(pool4, name):
    assert pool4.run(_case_op, name, "2d")[0] == []


# ---- data-dependent shapes: correct through the replicate fallback ---------------------------

def _grads_match(fn, fulls, dts) -> list[str]:
    """fn on DTensors against fn on plain tensors: the output and every input gradient."""
    refs = [f.clone().requires_grad_(True) for f in fulls]
    want = fn(*refs)
    want.backward(rand(want.shape, seed=7))
    got = fn(*dts)
    got.backward(make_dtensor(rand(want.shape, seed=7), got.device_mesh, [Replicate()] * got.device_mesh.ndim))
    errs = [mismatch(got.full_tensor(), want.detach())]
    errs += [mismatch(d.grad.full_tensor(), r.grad) for d, r in zip(dts, refs)]
    return [e for e in errs if e]


def _data_dependent(mesh_name: str) -> list[str]:
    """x[mask] reads, masked_select and masked_scatter have shapes that depend on the data
    (the meta kernel of nonzero refuses them): they run on replicated inputs, and so do the
    backward passes of writes whose values need x[mask] (index_put with a mask, masked_fill
    with a tensor value)."""
    from vescale import Partial, Shard
    m = mesh(mesh_name)
    x, v0, row = rand((3, 5, 6), 1), rand((), 2), rand((6,), 3)
    failures = []
    cases = {
        "x[mask]": (lambda a: a[a.detach() > 0] * 2, [x]),
        "x[:, mask2d]": (lambda a: a[:, a.detach()[0] > 0], [x]),
        "masked_select": (lambda a: a.masked_select(a.detach()[0, 0] > 0), [x]),
        "masked_scatter": (lambda a, s: a.masked_scatter(a.detach() > 0, s.expand(3, 5, 6) * 1), [x, row]),
        "setitem_mask_value_grad": (lambda a, s: _set(a, a.detach() > 0.5, s), [x, v0]),
        "setitem_mask_row_grad": (lambda a, s: _set(a, a.detach()[..., 0] > 0, s), [x, row]),
        "masked_fill_value_grad": (lambda a, s: a.masked_fill(a.detach() < 0, s), [x, v0]),
    }
    # (x's placement, the other input's) per mesh dim
    options = [(Replicate(), Partial()), (Shard(0), Replicate()), (Shard(2), Shard(0)), (Partial(), Replicate())]
    for name, (fn, fulls) in cases.items():
        for k in range(len(options)):
            ps = [[options[(k + md) % 4][0] for md in range(m.ndim)]]
            ps += [[options[(k + md) % 4][1] for md in range(m.ndim)] for _ in fulls[1:]]
            ps = [[Replicate() if q.is_shard() and f.dim() == 0 else q for q in p] for f, p in zip(fulls, ps)]
            dts = [make_dtensor(f, m, q, seed=4, requires_grad=True) for f, q in zip(fulls, ps)]
            failures += [f"{name} {ps}: {e}" for e in _grads_match(fn, fulls, dts)]
    return failures


@pytest.mark.parametrize("mesh_name", ["1d2", "2d"])
def test_data_dependent_indexing_matches(pool2, pool4, mesh_name):
    pool = pool2 if mesh_name == "1d2" else pool4
    for failures in pool.run(_data_dependent, mesh_name):
        assert failures == []


def _collectives(fn) -> list[str]:
    """The collectives that fn issues (the profiler sees the engine's calls too)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if e.name.startswith(("_c10d_functional::", "c10d::"))})


def _local_writes() -> dict:
    """Writes that every rank can do on its own shard issue no collective: a mask (or a
    scalar, or broadcast values) needs no gathered tensor. Also cat's skipped empty inputs."""
    from vescale import Shard
    m = mesh("1d2")
    x, row = rand((4, 6, 8), 1), rand((8,), 2)
    empty = torch.tensor([], dtype=x.dtype)
    out = {}

    def run(name, placements, fn):
        t = make_dtensor(x, m, placements)
        ref = x.clone()
        out[name] = _collectives(lambda: fn(t))
        fn(ref)
        err = mismatch(t.full_tensor(), ref)
        if err:
            out[name].append(f"wrong values: {err}")

    run("t[t > 0] = 0 (Shard(1))", [Shard(1)], lambda t: t.__setitem__(t > 0, 0.0))
    run("t[t < t[:, :1]] = -inf (Shard(2))", [Shard(2)], lambda t: t.__setitem__(t < t[:, :1], -float("inf")))
    run("t[[0, 1]] = 1 (Shard(2))", [Shard(2)], lambda t: t.__setitem__(torch.tensor([0, 1]), 1.0))
    run("t[:, [0, 1]] = row (Shard(2))", [Shard(2)],
        lambda t: t.__setitem__((slice(None), torch.tensor([0, 1])), make_dtensor(row, m, [Shard(0)])
                                if isinstance(t, vescale.DTensor) else row))
    t = make_dtensor(x, m, [Shard(2)])
    out["cat([empty, t], -2) (Shard(2))"] = _collectives(lambda: torch.cat([empty, t, empty], dim=-2))
    return out


def test_local_writes_need_no_collectives(pool2):
    for issued in pool2.run(_local_writes):
        assert issued == dict.fromkeys(issued, [])
