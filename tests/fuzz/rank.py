"""The rank side of the chain fuzzer: runs a program on plain tensors and on DTensors
and compares every value, then the input gradients.

Used as the handler of ``tests.opinfo.pool.Ranks`` ("tests.fuzz.rank:handle"): a message
is a list of program literals, the answer one verdict per program. Every rank computes
the same verdicts unless the engine made them diverge; the parent checks that.
"""

from __future__ import annotations

import random
import traceback
import warnings

import torch
import torch.distributed as dist

import vescale

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "python"))

from .chains import MESHES, PlainFactory, placements_from_codes, Program, fresh_placements, full_value, index_value, loss_of, run_program, run_step

_meshes: dict = {}


def setup() -> None:
    warnings.simplefilter("ignore")  # fallbacks warn once per op; the verdicts say what matters
    for name, shape in MESHES.items():
        n = 1
        for s in shape:
            n *= s
        if n <= dist.get_world_size():
            _meshes[name] = vescale.DeviceMesh("cpu", torch.arange(n).reshape(shape))


def make_dtensor(full: torch.Tensor, mesh, codes: list[str], seed: int) -> torch.Tensor:
    """A DTensor whose global value is ``full``; Partial shards hold genuinely different
    values (noise that the reduction cancels), so a missing reduction shows."""
    from dist_utils import make_dtensor as _make  # the tests' own builder (Partial noise included)
    return _make(full, mesh, placements_from_codes(codes), seed=seed)


class DTensorFactory(PlainFactory):
    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name
        self.mesh = _meshes[mesh_name]

    def input(self, shape, seed, placements, requires_grad):
        return make_dtensor(full_value(shape, seed), self.mesh, placements, seed).requires_grad_(requires_grad)

    def new(self, kind, shape, seed, high=None):
        if kind == "index":
            value = index_value(shape, seed, high)
            codes = fresh_placements(seed, shape, self.mesh_name, partial=False)
            # Indices come as plain tensors (implicitly replicated) or as sharded DTensors.
            return value if random.Random(seed).random() < 0.3 else vescale.distribute_tensor(
                value, self.mesh, placements_from_codes(codes))
        codes = fresh_placements(seed, shape, self.mesh_name, partial=True)
        return make_dtensor(full_value(shape, seed), self.mesh, codes, seed)


def _full(t):
    # detach first: reading a view whose base was written in place is no autograd use
    return t.detach().full_tensor() if isinstance(t, vescale.DTensor) else t


def _dim_order(shape, stride) -> list[int]:
    """Dims from outermost to innermost in memory; dims of one element have no place."""
    return sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: (-stride[d], d))


def _inf_where_nan_stands_for_it(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``actual`` with plain torch's +-inf where it has NaN there. A Partial value stays
    Partial through linear ops, so a factor of +-inf meets each rank's part: inf - inf or
    0 x inf is NaN where one device's (p0 + p1) x inf is +-inf (docs/engine.md). Non-finite
    either way; a finite value where one device has a non-finite one, or the reverse,
    still fails."""
    if not (actual.is_floating_point() and actual.shape == expected.shape and actual.dtype == expected.dtype):
        return actual
    stands_in = actual.isnan() & expected.isinf()
    return torch.where(stands_in, expected, actual) if stands_in.any() else actual


def _compare(what: str, actual, expected, expected_stride=None) -> str | None:
    """None when ``actual`` (a DTensor, or what the DTensor side gave) matches plain
    torch's ``expected``; ``expected_stride`` stands for its strides where ``expected``
    is a snapshot."""
    expected_stride = tuple(expected.stride()) if expected_stride is None else expected_stride
    if isinstance(actual, vescale.DTensor) and expected.numel() > 0:
        # The global strides must order the dims as plain torch's do: users read them
        # (is_contiguous, view), and draws in memory order follow them. Gaps may differ (a
        # gathered tensor is dense where a sliced one is not). The same on every rank.
        if _dim_order(expected.shape, actual.stride()) != _dim_order(expected.shape, expected_stride):
            return f"{what}: strides {tuple(actual.stride())} order the dims unlike plain torch's {expected_stride}"
    actual = _full(actual)
    if not isinstance(actual, torch.Tensor):
        return f"{what}: got {type(actual).__name__}, expected a tensor"
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{what}: dtype {actual.dtype} != {expected.dtype}"
    try:
        # NaN where plain torch has NaN is right, and only there (a gradient can be 0/0,
        # e.g. amax's over elements a later in-place write moved off the maximum; forward
        # values hold NaN and +-inf only from the chain's non-finite steps, chains.py)
        torch.testing.assert_close(_inf_where_nan_stands_for_it(actual.detach(), expected.detach()),
                                   expected.detach(), rtol=1e-7, atol=1e-9, equal_nan=True)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return f"{what}: " + "; ".join(lines[1:4])
    return None


def check(program: Program) -> tuple[str, str]:
    """("ok" | "wrong" | "error", detail)."""
    if program.mode.startswith("train"):
        return check_training(program)
    try:
        ref_inputs, ref_values = run_program(program, PlainFactory())
    except RuntimeError:  # drawn in grad mode: not every program runs in inference mode
        if program.mode == "grad":
            raise
        return "ok", ""
    ref_loss = loss_of(ref_values, PlainFactory().new, len(ref_inputs)) if program.mode == "grad" else None
    ref_backward_ok = ref_loss is not None
    if ref_backward_ok:
        try:
            ref_loss.backward()
        except RuntimeError:
            ref_backward_ok = False

    factory = DTensorFactory(program.mesh)
    stage = "forward"
    try:
        inputs, values = run_program(program, factory)
        stage = "comparing values"
        for k, (v, r) in enumerate(zip(values, ref_values)):
            if (bad := _compare(f"v{k}", v, r)) is not None:
                return "wrong", bad
        if not ref_backward_ok:
            return "ok", ""
        stage = "backward"
        loss = loss_of(values, factory.new, len(inputs))
        loss.backward()
        stage = "comparing gradients"
        for k, (x, r) in enumerate(zip(inputs, ref_inputs)):
            if r.grad is None:
                continue
            if x.grad is None:
                return "wrong", f"grad of v{k}: missing"
            if (bad := _compare(f"grad of v{k}", x.grad, r.grad)) is not None:
                return "wrong", bad
    except Exception as e:  # noqa: BLE001  (plain torch ran this program: any exception is a finding)
        return "error", f"{stage} {_where(e)}"
    return "ok", ""


# ---- training: two steps of an optimizer over the inputs ------------------------------------------

# Adam and Adagrad divide by the gradient's own size: with torch's eps (1e-8, 1e-10), a
# gradient that is zero on one device and rounding noise (1e-13) through a sharded sum
# becomes a step of up to lr x 1e-5, which no tight comparison of the updated values
# survives (campaign seeds 43002930, 43004967, 43005187). An eps of 1e-3 keeps the
# comparison tight and runs the same foreach and fused kernels.
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, eps=1e-3, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-3, foreach=True),
}


class _Mismatch(Exception):
    pass


def _train(program: Program, factory, seen) -> None:
    """Forward, backward, an optimizer step over the inputs that require grad, then the
    same steps again on the updated inputs (gradients zeroed or, as gradient accumulation
    does, kept), backward and another step. ``seen(label, tensor)`` is called at every
    point where the two sides must agree: the values after each forward and after each
    step (a view of an input follows its update), the gradients, the updated inputs."""
    _, optimizer, zero = program.mode.split(".")
    inputs, values = run_program(program, factory)
    params = [x for x in inputs if x.requires_grad and x.is_leaf]  # (an in-place step can make one a non-leaf)
    opt = OPTIMIZERS[optimizer](params) if params else None
    for round_ in (1, 2):
        if round_ == 2:
            values = list(inputs)
            for name, args, params_ in program.steps:
                values.append(run_step(values, factory, name, args, params_))
        for k, v in enumerate(values):
            seen(f"round {round_}: v{k}", v)
        loss = loss_of(values, factory.new, len(inputs))
        if loss is None or opt is None:
            return
        loss.backward()
        for k, x in enumerate(inputs):
            if x.grad is not None:
                seen(f"round {round_}: grad of v{k}", x.grad)
        opt.step()
        if zero != "keep":
            opt.zero_grad(set_to_none=zero == "none")
        for k, v in enumerate(values):
            seen(f"round {round_}, after the optimizer step: v{k}", v)


def check_training(program: Program) -> tuple[str, str]:
    expected = []
    try:
        _train(program, PlainFactory(),
               lambda label, t: expected.append((label, t.detach().clone(), tuple(t.stride()))))
    except (RuntimeError, IndexError, ValueError, TypeError):
        # plain torch refuses the second round (an in-place step squeezed an input, say)
        return "ok", ""
    position = iter(expected)

    def seen(label, t):
        ref_label, ref, stride = next(position, (None, None, None))
        if ref_label != label:
            raise _Mismatch(f"{label}: plain torch has {ref_label} here")
        if (bad := _compare(label, t, ref, stride)) is not None:
            raise _Mismatch(bad)

    try:
        _train(program, DTensorFactory(program.mesh), seen)
    except _Mismatch as e:
        return "wrong", str(e)
    except Exception as e:  # noqa: BLE001  (plain torch ran this program: any exception is a finding)
        return "error", _where(e)
    return "ok", ""


def _where(e: Exception) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames)
                  if "/fuzz/" in f.filename), "")
    return f"at {where}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"


def handle(literals: list) -> list:
    return [check(Program.from_literal(lit)) for lit in literals]
