"""Helpers that run inside the pool's ranks: meshes, DTensor inputs in any placement
(Partial included), placement enumeration and comparison with single-device results.

How training runs are compared with single-device training (fp32): rounding differs
with the summation order (sharded matmuls, all-reduces) and with the CPU's vector
units, so results agree only to rounding, and Adam turns that rounding into lr-sized
steps wherever a gradient is nearly zero (it divides by the gradient's magnitude).
So losses are compared at every step (rtol 1e-5), gradients of the first step tightly
relative to each tensor's largest element (``mismatch_to_max``), Adam-updated parameters
only within what Adam may move them (``adam_mismatch``), and SGD-updated parameters,
which move linearly with the gradients, tightly (``mismatch_to_max``)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed as dist

import vescale
from vescale import Partial, Replicate, Shard
from vescale.boxes import whole
from vescale.parallel import DDP
from vescale.parallel.ddp import local_of
from vescale.parallel.zero3 import _all_gather

MESHES = {
    "1d2": ((2,), ("TP",)),
    "1d4": ((4,), ("TP",)),
    "1d3": ((3,), ("TP",)),  # on ranks 0-2 of a 4-rank pool: sizes that do not divide
    "2d": ((2, 2), ("DP", "TP")),
}

_meshes: dict = {}


def mesh(name: str) -> vescale.DeviceMesh:
    """The named mesh (created once per rank: it makes process groups)."""
    if name not in _meshes:
        shape, names = MESHES[name]
        _meshes[name] = vescale.DeviceMesh("cpu", torch.arange(dist.get_world_size())[: _numel(shape)].reshape(shape),
                                           mesh_dim_names=names)
    return _meshes[name]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """The same values on every rank."""
    return torch.randn(shape, generator=seeded(seed), dtype=dtype)


def placement_options(ndim: int, mesh_ndim: int, *, partial: Sequence[str] = ("sum",)) -> list[list]:
    """Every placement list for a tensor of rank ``ndim`` on a mesh of rank ``mesh_ndim``."""
    per_dim = [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial(op) for op in partial]
    return [list(p) for p in itertools.product(per_dim, repeat=mesh_ndim)]


def combos(options: list[list], limit: int = 300) -> list[tuple]:
    """All combinations of the inputs' options when few; otherwise a covering set in
    which every option of every input appears (the others rotate through theirs)."""
    total = 1
    for o in options:
        total *= len(o)
    if total <= limit:
        return list(itertools.product(*options))
    out = []
    for i, opts in enumerate(options):
        for k, o in enumerate(opts):
            out.append(tuple(o if j == i else options[j][(k + j) % len(options[j])] for j in range(len(options))))
    return out


def _to_c(placements):
    return vescale.placement_types.to_c(placements)


def make_dtensor(full: torch.Tensor, m: vescale.DeviceMesh, placements, *, seed: int = 0,
                 requires_grad: bool = False) -> torch.Tensor:
    """A DTensor whose global value is ``full``, built from hand-made shards.

    Partial placements get genuinely different shard values (random noise that the
    reduction cancels), so a rule that forgets to reduce shows up."""
    coord = m.get_coordinate()
    boxed = [Replicate() if p.is_partial() else p for p in placements]
    sizes, _ = vescale._C.local_shape(list(full.shape), _to_c(boxed), list(m.shape), list(coord))
    local = torch.empty(sizes, dtype=full.dtype)
    for shard_box, global_box in vescale.dtensor._shard_parts(list(full.shape), m, _to_c(boxed)):
        shard_box.view_of(local, whole(sizes)).copy_(global_box.view_of(full, whole(full.shape)))
    for md, p in enumerate(placements):
        if not p.is_partial():
            continue
        k, c = m.shape[md], coord[md]
        # The same noise on every rank that must hold the same value before this split:
        # it may vary only with the coordinates of sharded mesh dims.
        sharded = tuple(x for j, x in enumerate(coord) if placements[j].splits())
        noise = torch.randn(local.shape, generator=seeded(hash((seed, md, sharded)) % (2**31)), dtype=local.dtype)
        if p.reduce_op == "sum":
            local = local - (k - 1) * noise if c == 0 else noise
        elif p.reduce_op == "avg":
            local = local + (k - 1) * noise if c == 0 else local - noise
        elif p.reduce_op == "max":
            local = local if c == 0 else local - noise.abs() - 0.1
        else:
            local = local if c == 0 else local + noise.abs() + 0.1
    out = vescale.DTensor.from_local(local, m, placements, shape=full.shape, stride=full.stride())
    return out.requires_grad_(requires_grad)


def mismatch(actual: torch.Tensor, expected: torch.Tensor, *, rtol=1e-7, atol=1e-9) -> str | None:
    """None when close; otherwise a short description."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        return str(e).splitlines()[-1] if str(e) else "values differ"
    return None


def describe(placements) -> str:
    return "[" + ", ".join(repr(p) for p in placements) + "]"


def mismatch_to_max(actual: torch.Tensor | None, expected: torch.Tensor | None, *, tol=1e-5,
                    atol=0.0) -> str | None:
    """None when the largest error is at most ``tol`` times the largest |expected| (plus
    ``atol``).

    For gradients and SGD-updated parameters: their rounding errors are relative to the
    tensor's large elements, which an element-wise rtol would demand of near-zero ones.
    ``atol`` is for tensors that are all near zero (a bias whose exact gradient is zero
    holds rounding noise alone)."""
    if actual is None or expected is None:
        return None if actual is None and expected is None else f"{actual is None=}, {expected is None=}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    if err <= tol * scale + atol:
        return None
    return (f"largest error {err:.3g} is {err / scale if scale else float('inf'):.3g} of the largest |value| "
            f"{scale:.3g} (up to {tol}{f' + {atol:g}' if atol else ''} allowed)")


def training_mismatches(losses, ref_losses, grads: dict, ref_grads: dict) -> list[str]:
    """Losses of every step (rtol 1e-5) and first-step gradients (``mismatch_to_max``)
    against single-device training; one line per disagreement."""
    failures = []
    err = mismatch(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    if err:
        failures.append(f"losses {losses} vs {ref_losses}: {err}")
    for name, g in grads.items():
        err = mismatch_to_max(g, ref_grads[name])
        if err:
            failures.append(f"first-step gradient of {name}: {err}")
    return failures


def adam_mismatch(actual: torch.Tensor, expected: torch.Tensor, *, lr: float, steps: int,
                  atol=1e-6) -> str | None:
    """None when every element is within 2 * lr * steps (+ atol) of the reference.

    An Adam(W) step moves an element by about lr at most, whatever its gradient, and
    where a gradient is nearly zero the two runs' rounding noise decides the direction:
    each run may walk that far, in opposite directions. A bound, not a tight check:
    losses and first-step gradients are the tight checks of an Adam run."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bound = 2 * lr * steps + atol
    err = (actual.double() - expected.double()).abs().max().item()
    if err <= bound:  # also False for NaN
        return None
    return f"moved {err:.3g} away from the reference, more than 2 * lr * steps = {bound:.3g}"


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole gradient after backward (before the optimizer step), by name.

    Under DDP these are the averaged gradients; with ZeRO-2/3 each rank keeps only its
    DP slice of the flat local gradient, so the slices are all-gathered back first.
    A frozen parameter's is its ``.grad`` (None)."""
    ddp = model if isinstance(model, DDP) else None
    inner = model.module if ddp is not None else model
    out = {}
    for name, p in inner.named_parameters():
        if ddp is not None and ddp.reduce_scatter and p.requires_grad:  # (a frozen one has no slot)
            _, slot = ddp._slot_of[id(p)]
            mine = ddp.grad_shards.get(id(p))
            mine = torch.zeros(slot.chunk, dtype=local_of(p).dtype) if mine is None else mine.contiguous()
            rows = torch.empty(ddp.world * slot.chunk, dtype=mine.dtype)
            _all_gather(rows, mine, ddp.group).wait()
            local = rows[: slot.numel].view(local_of(p).shape)
            grad = (vescale.DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    if isinstance(p, vescale.DTensor) else local)
        else:
            grad = p.grad
        if isinstance(grad, vescale.DTensor):
            grad = grad.full_tensor()
        out[name] = None if grad is None else grad.detach().clone()
    return out
