"""How each op of the fuzzer's table (ops.py) draws its arguments from the values a chain
holds so far: ``draw(rng, values)`` returns the indices of the values it consumes and its
non-tensor parameters, or None when nothing fits. A draw may be loose: the generator runs
the step on plain tensors and keeps it only if torch accepts it.
"""

from __future__ import annotations

import random

import torch


def _floats(values) -> list[int]:
    return [i for i, v in enumerate(values) if v.is_floating_point()]


def _pick(rng: random.Random, candidates: list[int]) -> int | None:
    return rng.choice(candidates) if candidates else None


def _dim(rng: random.Random, t: torch.Tensor) -> int | None:
    return rng.randrange(-t.dim(), t.dim()) if t.dim() else None


# ---- drawing helpers: one tensor, optionally a dim --------------------------------------------

def unary(rng, values):
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {})


def with_dim(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() > 0])
    return None if i is None else ((i,), {"dim": _dim(rng, values[i])})


def with_dim_keepdim(rng, values):
    drawn = with_dim(rng, values)
    if drawn is None:
        return None
    args, params = drawn
    return args, {**params, "keepdim": rng.random() < 0.4}


def binary(rng, values):
    """Two float values of broadcastable shapes (the generator drops pairs torch refuses),
    or one value and a scalar."""
    floats = _floats(values)
    if not floats:
        return None
    a = rng.choice(floats)
    same = [j for j in floats if values[j].shape == values[a].shape or values[j].dim() < values[a].dim()]
    return (a, rng.choice(same)), {}


def two_dims(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() >= 2])
    if i is None:
        return None
    d0, d1 = rng.sample(range(values[i].dim()), 2)
    return (i,), {"d0": d0, "d1": d1}


def unit_dim(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] == 1]
    if not cands:
        return None
    j, d = rng.choice(cands)
    return (j,), {"dim": d}


def new_dim(rng, values):
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {"dim": rng.randrange(-values[i].dim() - 1, values[i].dim() + 1)})


def narrowing(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] >= 1]
    if not cands:
        return None
    j, d = rng.choice(cands)
    size = values[j].shape[d]
    start = rng.randrange(size)
    return (j,), {"dim": d, "start": start, "length": rng.randrange(0, size - start + 1)}


def selecting(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] >= 1]
    if not cands:
        return None
    j, d = rng.choice(cands)
    return (j,), {"dim": d, "index": rng.randrange(-values[j].shape[d], values[j].shape[d])}


def reshaping(rng, values):
    """Merge two neighbouring dims, or split one into factors."""
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() > 0])
    if i is None:
        return None
    shape = list(values[i].shape)
    d = rng.randrange(len(shape))
    if d + 1 < len(shape) and rng.random() < 0.5:
        shape[d:d + 2] = [shape[d] * shape[d + 1]]
    else:
        n = shape[d]
        f = rng.choice([f for f in range(1, n + 1) if n % f == 0] or [0])
        shape[d:d + 1] = [f, n // f if f else 0]
    if rng.random() < 0.2 and shape:
        shape[rng.randrange(len(shape))] = -1 if all(s > 0 for s in shape) else shape[0]
    return (i,), {"shape": tuple(shape)}


def permuting(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() >= 2])
    if i is None:
        return None
    perm = list(range(values[i].dim()))
    rng.shuffle(perm)
    return (i,), {"perm": tuple(perm)}


def expanding(rng, values):
    i = _pick(rng, _floats(values))
    if i is None:
        return None
    return (i,), {"lead": rng.randint(1, 3)}


def fresh_same(rng, values):
    """A value and a new input of the same shape (for ops needing equal shapes)."""
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {"fresh": "same", "seed": rng.randrange(1 << 20)})


def matmul_draw(rng, values):
    i = _pick(rng, [j for j in _floats(values) if 1 <= values[j].dim() <= 4])
    if i is None:
        return None
    return (i,), {"fresh": "weight", "n": rng.randint(1, 6), "seed": rng.randrange(1 << 20)}


def index_draw(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] >= 1]
    if not cands:
        return None
    j, d = rng.choice(cands)
    return (j,), {"dim": d, "n": rng.randint(0, 5), "seed": rng.randrange(1 << 20), "fresh": "index"}


def scalar_draw(rng, values):
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {"s": rng.choice([-2.0, -0.5, 0.5, 1.5, 3.0])})


def poison_draw(rng, values):
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {"kind": rng.choice(["nan", "inf", "mask"])})


def cat_draw(rng, values):
    floats = _floats(values)
    if not floats:
        return None
    a = rng.choice(floats)
    if values[a].dim() == 0:
        return None
    d = rng.randrange(values[a].dim())
    same = [j for j in floats if values[j].dim() == values[a].dim() and all(
        values[j].shape[k] == values[a].shape[k] for k in range(values[a].dim()) if k != d)]
    return (a, rng.choice(same)), {"dim": d}


def setitem_draw(rng, values):
    drawn = narrowing(rng, values)
    if drawn is None:
        return None
    args, params = drawn
    return args, {**params, "s": rng.choice([0.0, 1.0, -2.5])}


def dropout_draw(rng, values):
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {"p": rng.choice([0.25, 0.5]), "seed": rng.randrange(1 << 20)})


def checkpoint_draw(rng, values):
    """dropout's draw, and whether the checkpoint is reentrant."""
    drawn = dropout_draw(rng, values)
    return None if drawn is None else (drawn[0], {**drawn[1], "reentrant": rng.random() < 0.5})


def cross_entropy_draw(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() == 2 and values[j].shape[1] >= 1])
    if i is None:
        return None
    return (i,), {"seed": rng.randrange(1 << 20), "fresh": "target"}


def inplace(draw):
    """The same draw, retried until the written value is not a leaf that requires grad
    (torch refuses in-place writes into those, so the chain would rarely keep one)."""
    def draw_mutable(rng, values):
        for _ in range(8):
            drawn = draw(rng, values)
            if drawn is not None and not (values[drawn[0][0]].is_leaf and values[drawn[0][0]].requires_grad):
                return drawn
        return None
    return draw_mutable


# ---- draws of the second table: shifts, masks, scatters, pads, optimizer updates ------------

def with_dim_shift(rng, values):
    drawn = with_dim(rng, values)
    return None if drawn is None else (drawn[0], {**drawn[1], "shift": rng.choice([-3, -1, 1, 2, 5])})


def with_offset(rng, values):
    """A value of 2+ dims and a diagonal offset (tril / triu act on the last two dims)."""
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() >= 2])
    return None if i is None else ((i,), {"k": rng.choice([-2, -1, 0, 0, 1, 3])})


def diagonal_draw(rng, values):
    drawn = two_dims(rng, values)
    return None if drawn is None else (drawn[0], {**drawn[1], "offset": rng.choice([-1, 0, 0, 1, 2])})


def repeats_draw(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() > 0])
    if i is None:
        return None
    return (i,), {"reps": tuple(rng.choice([1, 1, 2, 3]) for _ in range(values[i].dim() + rng.choice([0, 0, 1])))}


def pad_draw(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() > 0])
    if i is None:
        return None
    sides = rng.choice([1, 2]) if values[i].dim() >= 2 else 1
    return (i,), {"pad": tuple(rng.choice([0, 1, 2, -1]) for _ in range(2 * sides)), "value": rng.choice([0.0, 1.5])}


def sizes_draw(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] >= 1]
    if not cands:
        return None
    j, d = rng.choice(cands)
    first = rng.randrange(values[j].shape[d] + 1)
    return (j,), {"dim": d, "sizes": (first, values[j].shape[d] - first), "part": rng.randrange(2)}


def unfold_draw(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] >= 1]
    if not cands:
        return None
    j, d = rng.choice(cands)
    return (j,), {"dim": d, "size": rng.randint(1, min(3, values[j].shape[d])), "step": rng.choice([1, 2])}


def random_draw(rng, values):
    i = _pick(rng, _floats(values))
    return None if i is None else ((i,), {"seed": rng.randrange(1 << 20)})


def group_norm_draw(rng, values):
    cands = [j for j in _floats(values) if values[j].dim() >= 2 and values[j].shape[1] > 0 and values[j].shape[0] > 0]
    if not cands:
        return None
    j = rng.choice(cands)
    c = values[j].shape[1]
    return (j,), {"groups": rng.choice([g for g in (1, 2, 3) if c % g == 0]), "seed": rng.randrange(1 << 20),
                  "fresh": "weight"}

def attention_draw(rng, values):
    """A 4-d value as keys and values (batch, heads, sequence, features), with a fresh
    query of its shape: the attention kernels read shards' layouts themselves."""
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() == 4 and min(values[j].shape[-2:]) > 0])
    if i is None:
        return None
    return (i,), {"fresh": "weight", "causal": rng.random() < 0.5, "seed": rng.randrange(1 << 20)}


def relayout_draw(rng, values):
    i = _pick(rng, _floats(values))
    if i is None:
        return None
    return (i,), {"seed": rng.randrange(1 << 20)}


# ---- draws of the third table: losses, convolutions, pools, data-dependent indices ------------

def conv_draw(rng, values):
    """A 3-d value as (batch, channels, length) and a fresh kernel of width 1-3."""
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() == 3 and values[j].shape[1] > 0])
    if i is None:
        return None
    return (i,), {"n": rng.randint(1, 4), "k": rng.randint(1, 3), "pad": rng.randint(0, 1),
                  "seed": rng.randrange(1 << 20), "fresh": "weight"}


def pool_draw(rng, values):
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() == 3])
    return None if i is None else ((i,), {"k": rng.choice([1, 2, 3]), "stride": rng.choice([1, 2])})


def even_dim(rng, values):
    cands = [(j, d) for j in _floats(values) for d in range(values[j].dim()) if values[j].shape[d] % 2 == 0]
    if not cands:
        return None
    j, d = rng.choice(cands)
    return (j,), {"dim": d}


def last_dim_index_draw(rng, values):
    """A value and a fresh index over its last dim, shaped like its leading dims."""
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() >= 1 and values[j].shape[-1] > 0])
    return None if i is None else ((i,), {"seed": rng.randrange(1 << 20), "fresh": "index"})


def last_even_fresh(rng, values):
    """A value whose last dim is even (pairs of it become complex numbers), and a seed."""
    i = _pick(rng, [j for j in _floats(values) if values[j].dim() >= 1 and values[j].shape[-1] % 2 == 0
                    and values[j].shape[-1] > 0])
    return None if i is None else ((i,), {"seed": rng.randrange(1 << 20), "fresh": "weight"})


def with_dim_fresh(rng, values):
    drawn = with_dim(rng, values)
    return None if drawn is None else (drawn[0], {**drawn[1], "seed": rng.randrange(1 << 20), "fresh": "weight"})
