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
    kind: str = "float"      # float | positive | index:<n> | target:<n>
    grad: bool = True

    def make(self, seed: int) -> torch.Tensor:
        if self.kind.startswith(("index", "target")):
            high = int(self.kind.split(":")[1])
            t = torch.randint(0, high, self.shape, generator=torch.Generator().manual_seed(seed))
            if self.kind.startswith("target") and t.numel() > 2:
                t.view(-1)[1] = -100  # an ignored target
            return t
        t = rand(self.shape, seed)
        return t.abs() + 0.5 if self.kind == "positive" else t

    @property
    def differentiable(self) -> bool:
        return self.grad and not self.kind.startswith(("index", "target"))


@dataclass
class Case:
    name: str
    fn: Callable
    args: list = field(default_factory=list)
    partial: bool = True  # offer Partial inputs


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
    ]


CASES = {c.name: c for c in _cases()}


def _options(arg: Arg, mesh_ndim: int, first: bool, partial: bool):
    if arg.kind.startswith(("index", "target")):
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
            err = mismatch(out.full_tensor(), ref_out.detach())
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
                err = mismatch(t.grad.full_tensor(), ref_grads[k])
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
