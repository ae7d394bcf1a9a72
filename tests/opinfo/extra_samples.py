"""Samples that torch's op_db lacks, or holds only beyond the first few that the runner
takes: the forms real model code uses and a rule can get wrong by assuming every
operand has the full shape. Legacy 1-d empty inputs of cat (Hugging Face's KV cache
starts from ``torch.tensor([])``), values of index_put that broadcast (0-d, fewer
dims, unit dims: nanoGPT's ``logits[logits < v[:, [-1]]] = -inf``), bool masks over
some dims, indices that are not adjacent, and 0-d operands of the indexing family.

The runner appends these to torch's first samples of the op (``check._samples``); with
``max_samples=0`` only these run (tests/opinfo/test_opinfo_subset.py). Index tensors
hold no repeated position unless every value written there is the same (a repeated
position otherwise gets whichever write comes last, which no two stacks need agree on).
"""

from __future__ import annotations

import torch
from torch.testing._internal.opinfo.core import SampleInput


def _t(shape, dtype, requires_grad, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


def _cat(dtype, rg):
    def t(shape, seed):
        return _t(shape, dtype, rg, seed)

    return [
        SampleInput([t((0,), 1), t((2, 3, 4), 2)], kwargs={"dim": -2}),               # first, as the KV cache
        SampleInput([t((2, 3, 4), 3), t((0,), 4), t((2, 5, 4), 5)], kwargs={"dim": 1}),  # middle
        SampleInput([t((3, 4), 6), t((3, 4), 7), t((0,), 8)], kwargs={"dim": -1}),      # last
        SampleInput([t((0,), 9), t((0,), 10)], kwargs={"dim": -2}),                    # every one empty
        SampleInput([t((0,), 11), t((5,), 12), t((0,), 13)], kwargs={"dim": 0}),       # 1-d, not empty
    ]


def _stack(dtype, rg):
    return [SampleInput([_t((0,), dtype, rg, 1), _t((0,), dtype, rg, 2)], kwargs={"dim": 0})]


def _index_put(dtype, rg):
    def t(shape, seed, grad=rg):
        return _t(shape, dtype, grad, seed)

    x = lambda seed: t((3, 5, 6), seed)  # noqa: E731
    mask = t((3, 5, 6), 20, grad=False) > 0
    rows = t((3, 5), 21, grad=False) > 0
    i = torch.tensor([2, 0])
    return [
        SampleInput(x(1), args=((mask,), t((), 2)), kwargs={"accumulate": False}),      # x[x > 0] = 0
        SampleInput(x(3), args=((i,), t((), 4)), kwargs={"accumulate": False}),         # x[[2, 0]] = 0
        SampleInput(x(5), args=((i,), t((1, 1, 6), 6)), kwargs={"accumulate": False}),  # unit dims
        SampleInput(x(7), args=((i,), t((6,), 8)), kwargs={"accumulate": True}),        # fewer dims
        SampleInput(x(9), args=((rows,), t((6,), 10)), kwargs={"accumulate": False}),   # mask over 2 dims
        SampleInput(x(11), args=((rows,), t((1,), 12)), kwargs={"accumulate": True}),
        SampleInput(x(13), args=((torch.tensor([0, 2, 0]), torch.tensor([1, 4, 1])), t((6,), 14)),
                    kwargs={"accumulate": True}),                                       # repeated, accumulated
        SampleInput(x(15), args=((torch.tensor(1),), t((5, 1), 16)), kwargs={"accumulate": False}),  # 0-d index
    ]


def _index_select(dtype, rg):
    return [SampleInput(_t((3, 5), dtype, rg, 1), args=(1, torch.tensor(3))),
            SampleInput(_t((3, 5), dtype, rg, 2), args=(0, torch.tensor([2, 0, 2])))]


def _getitem(dtype, rg):
    x = _t((3, 5, 6), dtype, rg, 1)
    return [
        SampleInput(x, args=((torch.tensor([0, 2]), slice(None), torch.tensor([1, 5])),)),  # not adjacent
        SampleInput(x, args=((slice(None), torch.tensor(4)),)),                             # 0-d index
        SampleInput(x, args=((slice(None), _t((5, 6), torch.float64, False, 2) > 0),)),     # mask, 2 dims
    ]


def _masked_fill(dtype, rg):
    x = _t((3, 5, 6), dtype, rg, 1)
    return [SampleInput(x, args=(_t((5, 1), torch.float64, False, 2) > 0, _t((), dtype, False, 3))),
            SampleInput(x, args=(_t((6,), torch.float64, False, 4) > 0, -1.5))]


def _where(dtype, rg):
    return [SampleInput(_t((3, 5, 6), dtype, rg, 1), args=(_t((6,), torch.float64, False, 2) > 0, _t((), dtype, rg, 3)))]


def _gather(dtype, rg):
    return [SampleInput(_t((), dtype, rg, 1), args=(0, torch.tensor(0))),
            SampleInput(_t((3, 5), dtype, rg, 2), args=(1, torch.tensor([[4], [0], [2]])))]


def _scatter(dtype, rg):
    return [SampleInput(_t((), dtype, rg, 1), args=(0, torch.tensor(0), _t((), dtype, rg, 2)))]


EXTRA = {
    "cat": _cat,
    "stack": _stack,
    "index_put": _index_put,
    "index_select": _index_select,
    "__getitem__": _getitem,
    "masked_fill": _masked_fill,
    "where": _where,
    "gather": _gather,
    "scatter": _scatter,
}


def extra_samples(key: str, dtype: torch.dtype, requires_grad: bool) -> list:
    make = EXTRA.get(key)
    return make(dtype, requires_grad) if make else []
