"""The rank side: one OpInfo on one stack (vescale or torch's DTensor) and one mesh.

For every sample the op first runs on plain tensors: the reference outputs, and the
gradients of sum(out * g) for the differentiable inputs. Then, for each combination of
input placements, it runs on DTensors whose global values are the sample's tensors, and
the gathered outputs and gradients are compared with the reference.

Every rank runs the same samples (seeded alike) and the same combinations in the same
order, so the collectives line up. The first exception ends the op on that rank: the ranks
may then be out of step, which the parent sees from where each rank stopped.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import sys
import traceback
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._comparison import default_tolerances
from torch.utils._pytree import tree_flatten, tree_unflatten

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

import vescale  # noqa: E402
from dist_utils import mesh as named_mesh, placement_options  # noqa: E402
from .extra_samples import extra_samples  # noqa: E402
from vescale import Replicate  # noqa: E402

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
STATUS_ORDER = ("pass", "fallback", "skipped", "fail", "hang", "crash")  # worst last
# Shards add up in another order than one device does: allow a few times what float32
# rounding does to the op on this very sample (measured against float64).
SLACK_FACTOR = 8
TRACE = os.environ.get("OPINFO_TRACE") == "1"  # log each combination (find where a hang is)
OPS: dict = {}


@dataclass
class Outcome:
    status: str                     # pass | fallback | fail | skipped (hang, crash: the parent)
    reason: str = ""
    samples: int = 0                # samples that ran on DTensors
    combos: int = 0                 # placement combinations checked
    failed_combos: int = 0
    fallbacks: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    stopped_at: tuple = ()          # (sample, combination) where an exception ended the op


@dataclass
class Reference:
    flat: list                      # the sample's (input, args, kwargs) leaves; pristine tensors
    spec: object                    # to rebuild (input, args, kwargs) from ``flat``
    out: list                       # flattened outputs
    slack: list                     # per output: float32 rounding, measured
    comparable: bool                # False when the output is uninitialized memory (empty_like)
    random: bool                    # the op draws from the RNG
    n_processed: int = 0            # outputs after the OpInfo's output_process_fn_grad
    diff_out: list = field(default_factory=list)    # which of those backward goes through
    grad_out: list = field(default_factory=list)    # the fixed g of each
    grads: dict = field(default_factory=dict)       # leaf index -> gradient
    grad_slack: dict = field(default_factory=dict)  # leaf index -> its rounding


def setup() -> None:
    """Once per rank: op_db, and both meshes (making process groups is a collective)."""
    warnings.filterwarnings("ignore")  # fallback notices, deprecations: the results say it all
    logging.disable(logging.WARNING)    # torch.distributed's advice on slow redistributions
    from torch.testing._internal.common_methods_invocations import op_db
    OPS.update((op_key(op), op) for op in op_db)
    for name in ("1d4", "2d"):
        named_mesh(name)


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def handle(msg) -> dict:
    _, key, stack, mesh_name, opts = msg
    return vars(run_op(OPS[key], stack, mesh_name, **opts))


# ---- one op --------------------------------------------------------------------------

def run_op(op, stack: str, mesh_name: str, *, max_samples: int, combo_limit: int) -> Outcome:
    dtype = next((d for d in FLOAT_DTYPES if d in op.supported_dtypes("cpu")), None)
    if dtype is None:
        return Outcome("skipped", "no floating dtype on CPU")
    try:
        samples = _samples(op, dtype, max_samples)
    except Exception as e:  # noqa: BLE001
        return Outcome("skipped", f"sample_inputs raised {_short(e)}")
    if not _same_on_all_ranks(samples):
        return Outcome("skipped", "sample_inputs gave different values on different ranks")
    mesh = named_mesh(mesh_name)
    result = Outcome("pass", notes=[] if dtype == torch.float32 else [str(dtype).replace("torch.", "")])
    skipped = "no sample runs on plain tensors"
    vescale.reset_fallback_counts()
    for i, sample in enumerate(samples):
        ref = _reference(op, sample, seed=1000 + i)
        if ref is None:
            continue  # the op rejects this sample on plain tensors too
        tensors = [x for x in ref.flat if isinstance(x, torch.Tensor)]
        if not tensors or any(t.layout != torch.strided for t in tensors):
            skipped = "no dense tensor inputs (factory or sparse op: nothing to distribute)"
            continue
        ref.comparable &= "empty" not in op.name  # uninitialized memory may repeat by chance
        result.notes += [n for n, on in (("random", ref.random), ("uninitialized", not ref.comparable))
                         if on and n not in result.notes]
        result.samples += 1
        if not _run_sample(op, sample, i, ref, stack, mesh, combo_limit, result):
            break
    if result.samples == 0:
        return Outcome("skipped", skipped)
    if stack == "vescale":
        result.fallbacks = vescale.fallback_counts()
        if result.status == "pass" and result.fallbacks:
            result.status = "fallback"
    return result


def _run_sample(op, sample, i: int, ref: Reference, stack: str, mesh, limit: int, result: Outcome) -> bool:
    """Checks every combination; False when an exception ended the op."""
    for j, combo in enumerate(_combos(ref, mesh.ndim, limit)):
        result.combos += 1
        label = f"sample {i} [{' '.join(_describe(p) for p in combo)}]"
        if TRACE:
            print(f"{op_key(op)} {stack} {mesh.shape} {label}", file=sys.stderr, flush=True)
        try:
            err = _check_combo(op, sample, ref, combo, stack, mesh, seed=1000 + i)
        except Exception as e:  # noqa: BLE001
            result.status, result.reason, result.stopped_at = "fail", f"{label}: {_short(e)}", (i, j)
            return False
        if err:  # a mismatch leaves the ranks in step: go on, to count the failing combinations
            result.failed_combos += 1
            if result.status == "pass":
                result.status, result.reason = "fail", f"{label}: {err}"
    return True


def _samples(op, dtype, limit: int) -> list:
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(0)  # sample values are random: every rank must draw the same
    grad = op.supports_autograd and dtype.is_floating_point
    samples = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=grad), limit))
    return samples + extra_samples(op_key(op), dtype, grad)  # forms op_db lacks (extra_samples.py)


def _same_on_all_ranks(samples) -> bool:
    prints = []
    for s in samples:
        for t in tree_flatten((s.input, s.args, s.kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                v = (torch.view_as_real(t) if t.is_complex() else t).detach().double().nan_to_num(0, 1e300, -1e300)
                prints.append((tuple(t.shape), str(t.dtype), float(v.sum()), float((v.flatten() * torch.arange(v.numel())).sum())))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, prints)
    return all(g == gathered[0] for g in gathered)


# ---- the single-device reference ----------------------------------------------------

def _fresh_leaves(flat: list) -> list:
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in flat]


def _call(op, flat: list, spec, seed: int):
    inp, args, kwargs = tree_unflatten(flat, spec)
    torch.manual_seed(seed)  # random ops: the DTensor run draws alike
    return op(inp, *args, **kwargs)


def _reference(op, sample, seed: int) -> Reference | None:
    flat, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    flat = _fresh_leaves(flat)  # pristine copies: an op may write into its inputs
    leaves = _fresh_leaves(flat)
    torch.manual_seed(seed)
    seeded = torch.get_rng_state()
    outs, drew = [], False
    try:
        outs.append(_call(op, leaves, spec, seed))
        drew = not torch.equal(torch.get_rng_state(), seeded)
        outs.append(_call(op, _fresh_leaves(flat), spec, seed))
    except Exception:  # noqa: BLE001  (the op rejects this sample on plain tensors too)
        pass
    first, again = (tree_flatten(o)[0] for o in outs) if len(outs) == 2 else ([], [])
    # OpInfo's random ops seed themselves (wrapper_set_seed), restoring the RNG state after.
    drew |= "wrapper_set_seed" in getattr(getattr(op.op, "__code__", None), "co_names", ())
    seen = _agree(failed=len(outs) < 2, uninitialized=not _identical(first, again), random=drew)
    if seen["failed"]:
        return None
    ref = Reference(flat, spec, [_detach(o) for o in first], [0.0] * len(first),
                    comparable=not seen["uninitialized"], random=seen["random"])
    _reference_grads(ref, sample, outs[0], leaves, seed)
    if not ref.random and any(_is_f32(x) for x in flat):
        _measure_slack(op, sample, ref, seed)
    return ref


def _agree(**flags) -> dict:
    """The flags OR-ed over all ranks: every rank must take the same path through the samples
    (one that skipped a sample would leave the others waiting in a collective)."""
    t = torch.tensor([int(v) for v in flags.values()])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(flags, (bool(v) for v in t.tolist())))


def _reference_grads(ref: Reference, sample, out, leaves: list, seed: int) -> None:
    """Gradients of sum(out * g) for a fixed g; none when the op has no backward here."""
    wrt = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    processed = tree_flatten(sample.output_process_fn_grad(out))[0]
    ref.n_processed = len(processed)
    diff = [k for k, o in enumerate(processed)
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    if not wrt or not diff:
        return
    gen = torch.Generator().manual_seed(seed)
    grad_out = [torch.randn(processed[k].shape, generator=gen, dtype=processed[k].dtype) for k in diff]
    try:
        loss = sum((processed[k] * g).sum() for k, g in zip(diff, grad_out))
        grads = torch.autograd.grad(loss, [leaves[k] for k in wrt], allow_unused=True)
    except Exception:  # noqa: BLE001  (e.g. a backward that is not implemented)
        return
    ref.diff_out, ref.grad_out = diff, grad_out
    ref.grads = {k: torch.zeros_like(leaves[k]) if g is None else g.detach() for k, g in zip(wrt, grads)}
    ref.grad_slack = dict.fromkeys(ref.grads, 0.0)


def _measure_slack(op, sample, ref: Reference, seed: int) -> None:
    """How far float32 rounding takes this op from its float64 result, per output and gradient."""
    wide = [x.double().requires_grad_(x.requires_grad) if _is_f32(x) else x for x in _fresh_leaves(ref.flat)]
    try:
        out = _call(op, wide, ref.spec, seed)
        ref.slack = [_max_diff(a, b) for a, b in zip(ref.out, tree_flatten(out)[0])]
        if ref.grads:
            processed = tree_flatten(sample.output_process_fn_grad(out))[0]
            loss = sum((processed[k] * g.to(processed[k].dtype)).sum() for k, g in zip(ref.diff_out, ref.grad_out))
            grads = torch.autograd.grad(loss, [wide[k] for k in ref.grads], allow_unused=True)
            ref.grad_slack = {k: _max_diff(ref.grads[k], g) for k, g in zip(ref.grads, grads)}
    except Exception:  # noqa: BLE001  (no float64 kernel: the default tolerances alone apply)
        pass


def _is_f32(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float32


def _max_diff(a, b) -> float:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
            or not a.is_floating_point() or a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().nan_to_num(0.0, 0.0, 0.0).max())


def _detach(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def _identical(a: list, b: list) -> bool:
    try:
        torch.testing.assert_close([_detach(x) for x in a], [_detach(y) for y in b], rtol=0, atol=0, equal_nan=True)
    except (AssertionError, TypeError, ValueError):
        return False
    return True


# ---- placements ----------------------------------------------------------------------

def _combos(ref: Reference, mesh_ndim: int, limit: int) -> list:
    """Every combination when there are at most ``limit``; otherwise a covering set as long
    as the longest option list, in which every input takes each of its options."""
    options = []
    for x in ref.flat:
        if isinstance(x, torch.Tensor):
            # Partial only for finite floating tensors: the exact split below multiplies by 0.
            exact = x.is_floating_point() and bool(torch.isfinite(x).all())
            options.append(placement_options(x.dim(), mesh_ndim, partial=("sum",) if exact else ()))
    if np.prod([len(o) for o in options]) <= limit:
        return list(itertools.product(*options))
    longest = max(len(o) for o in options)
    return [tuple(o[(k + 3 * j) % len(o)] for j, o in enumerate(options)) for k in range(longest)]


def _describe(placements) -> str:
    text = ",".join("P" if p.is_partial() else f"S{p.dim}" if p.is_shard() else "R" for p in placements)
    return text if len(placements) == 1 else f"({text})"


_SPLITS: dict = {}


def _split_rows(k: int) -> torch.Tensor:
    """Ways to split x into k addends c_i * x whose partial sums, in any order, are x times
    0, +-1/2, +-1 or 2: the reduction is exact, so a Partial input holds exactly the sample's
    value (not the value plus rounding), while each rank's addend is far from it."""
    if k not in _SPLITS:
        base = [[1.0], [2.0, -1.0], [0.5, 0.5]] + ([[1.0, 1.0, -1.0]] if k >= 3 else [])
        rows = {p for b in base for p in itertools.permutations((b + [0.0] * k)[:k])}
        _SPLITS[k] = torch.tensor(sorted(rows), dtype=torch.float64)
    return _SPLITS[k]


def make_input(full: torch.Tensor, placements, stack: str, mesh, seed: int) -> torch.Tensor:
    """A DTensor of ``stack`` whose global value is ``full``; Partial dims get real addends,
    drawn per element on the full shape alike on every rank, then sharded."""
    full, coord = full.detach().contiguous(), mesh.get_coordinate()
    value = full
    for md, p in enumerate(placements):
        if p.is_partial():
            rows = _split_rows(mesh.shape[md])
            pick = torch.randint(len(rows), full.shape, generator=torch.Generator().manual_seed(seed * 31 + md))
            value = value * rows[pick][..., coord[md]].to(full.dtype)
    if stack == "vescale":
        boxed = [Replicate() if p.is_partial() else p for p in placements]
        sizes, offsets = vescale._C.local_shape(list(full.shape), vescale.placement_types.to_c(boxed),
                                                list(mesh.shape), list(coord))
    else:
        tmesh, placements = mesh.to_torch(), _to_torch(placements)
        boxed = [tdt.Replicate() if p.is_partial() else p for p in placements]
        sizes, offsets = compute_local_shape_and_global_offset(full.shape, tmesh, boxed)
    local = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
    if stack == "vescale":
        return vescale.DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
    return tdt.DTensor.from_local(local, tmesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _to_torch(placements) -> list:
    return [tdt.Shard(p.dim) if p.is_shard() else tdt.Partial("sum") if p.is_partial() else tdt.Replicate()
            for p in placements]


# ---- one combination -----------------------------------------------------------------

def _check_combo(op, sample, ref: Reference, combo, stack: str, mesh, seed: int) -> str | None:
    """None when outputs and gradients match the reference; otherwise what differed."""
    flat, leaves, placements = list(ref.flat), {}, iter(combo)
    for k, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            flat[k] = make_input(x, next(placements), stack, mesh, seed=seed * 7 + k)
            if x.requires_grad:
                leaves[k] = flat[k].requires_grad_(True)
    out = _call(op, flat, ref.spec, seed)
    got = tree_flatten(out)[0]
    if len(got) != len(ref.out):
        return f"forward: {len(got)} outputs, expected {len(ref.out)}"
    for k, (g, want) in enumerate(zip(got, ref.out)):
        err = _compare(_gathered(g), want, ref.slack[k], ref.comparable)
        if err:
            return f"forward out[{k}]: {err}"
    if not ref.grads:
        return None
    processed = tree_flatten(sample.output_process_fn_grad(out))[0]
    if len(processed) != ref.n_processed:
        return f"backward: {len(processed)} outputs to differentiate, expected {ref.n_processed}"
    for k in ref.diff_out:
        if not processed[k].requires_grad:
            return f"backward: output {k} does not require grad"
    sum((processed[k] * _like(g, processed[k], stack, mesh)).sum() for k, g in zip(ref.diff_out, ref.grad_out)).backward()
    for k, want in ref.grads.items():
        got = leaves[k].grad
        err = (None if not bool(want.any()) else "no gradient") if got is None else \
            _compare(_gathered(got), want, ref.grad_slack[k])
        if err:
            return f"backward grad of input {k}: {err}"
    return None


def _like(g: torch.Tensor, out, stack: str, mesh):
    """g as a replicated DTensor for a DTensor output (torch's DTensor refuses to mix)."""
    if not isinstance(out, (vescale.DTensor, tdt.DTensor)):
        return g
    if stack == "vescale":
        return vescale.DTensor.from_local(g, mesh, [Replicate()] * mesh.ndim)
    return tdt.DTensor.from_local(g, mesh.to_torch(), [tdt.Replicate()] * mesh.ndim, run_check=False)


def _gathered(x):
    if isinstance(x, (vescale.DTensor, tdt.DTensor)):
        with torch.no_grad():
            return x.full_tensor()
    return _detach(x)


def _compare(got, want, slack: float = 0.0, values: bool = True) -> str | None:
    """assert_close with its defaults for the dtype, atol widened by the measured rounding."""
    rtol = atol = None
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"got {type(got).__name__}, expected a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        if not values:
            return None
        if want.is_floating_point() or want.is_complex():
            rtol, atol = default_tolerances(want)
            atol += SLACK_FACTOR * slack
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
    except (AssertionError, TypeError, ValueError) as e:
        return _condense(str(e))
    return None


def _condense(msg: str) -> str:
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.startswith(("Mismatched elements", "Greatest absolute", "Expected", "Absolute"))]
    return "; ".join(keep) if keep else (lines[0] if lines else "values differ")


def _short(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    if lines:
        return f"{type(e).__name__}: {lines[0][:240]}"
    frame = traceback.extract_tb(e.__traceback__)[-1]  # a bare assert: where it was raised tells most
    return f"{type(e).__name__} at {os.path.basename(frame.filename)}:{frame.lineno} `{frame.line}`"
