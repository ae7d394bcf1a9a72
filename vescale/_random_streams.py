"""Random fills of deferred_init replayed for one box of the tensor (a rank's shard), with
the values and generator state of the single-device init: known fills draw only the box
(the Mersenne Twister skips the rest, in C++), others stream the whole sequence chunk by
chunk keeping the box, and trunc_normal_'s rejection rounds are streamed with the
rejected elements kept as bits. Memory: the shard, one chunk and n/8 bytes.

``node`` arguments are vescale.deferred's recorded ops (func, args, kwargs, rng, out,
python)."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _C
from .boxes import Box, flat_range, whole

if TYPE_CHECKING:
    from .deferred import _Node as Node

aten = torch.ops.aten
CHUNK = 1 << 20  # elements per streamed chunk (a multiple of 16: CPU normal_ works in groups of 16)

# random fills whose CPU kernels draw element by element in order (normal_: 16 at a time,
# the last 16 redrawn), so a chunked stream of the whole sequence equals one call
STREAMABLE = {aten.normal_.default: lambda t, a: t.normal_(*a),
               aten.uniform_.default: lambda t, a: t.uniform_(*a)}
RANDOM_FACTORIES = {aten.randn.default: (aten.normal_.default, (0.0, 1.0)),
                     aten.rand.default: (aten.uniform_.default, (0.0, 1.0))}


def random_fill(node: Node):
    """(fill function, its scalar arguments, the tensor filled) for a streamable node."""
    if node.python:
        return None
    if node.func in RANDOM_FACTORIES:
        fill, extra = RANDOM_FACTORIES[node.func]
        return STREAMABLE[fill], extra, node.out
    if node.func in STREAMABLE:
        return STREAMABLE[node.func], node.args[1:], node.args[0]
    return None


def _chunks(n: int) -> list[tuple[int, int]]:
    bounds = [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < 16:  # a short last chunk would draw differently
        (a, _), (_, b) = bounds[-2], bounds.pop()
        bounds[-1] = (a, b)
    return bounds


def _fill_params(node: Node) -> tuple[str, float, float]:
    """("normal_" | "uniform_", a, b): the fill's kind and its two scalar arguments."""
    if node.func in RANDOM_FACTORIES:
        fill, (a, b) = RANDOM_FACTORIES[node.func]
        return fill._schema.name.split("::")[1], a, b
    kind = node.func._schema.name.split("::")[1]
    names = ("mean", "std") if kind == "normal_" else ("from", "to")
    values = [0.0, 1.0]
    for i, v in enumerate(node.args[1:3]):
        values[i] = v
    for i, name in enumerate(names):
        if name in node.kwargs:
            values[i] = node.kwargs[name]
    return kind, float(values[0]), float(values[1])


def stream(node: Node, shape, dtype, box: Box | None, into: torch.Tensor | None) -> None:
    """The node's random values inside ``box`` (into ``into``), drawn from its recorded
    generator state; with no box (recording), just moves the real generator past the fill.

    Where the fill's use of the generator is known (normal_ on >= 16 float/double
    elements, uniform_), only the box's rows are drawn: the Mersenne Twister skips the
    rest (vescale._C._rng_draw_box; sharding_rules/random_local.h), in buffers of at most
    one chunk. Otherwise the whole sequence is streamed chunk by chunk, keeping the box."""
    kind, a, b = _fill_params(node)
    if not _draw_known(node.rng, kind, a, b, shape, dtype, box, into):
        _stream_whole(node, shape, dtype, box, into)


def _draw_known(rng: torch.Tensor, kind: str, a: float, b: float, shape, dtype, box: Box | None,
                into: torch.Tensor | None) -> bool:
    """A fill of ``kind`` from generator state ``rng``, box only (see stream); False when
    its use of the generator is not known (nothing drawn then)."""
    if box is None:
        torch.set_rng_state(rng)
        return _C._rng_skip(kind, dtype, math.prod(shape))
    saved = torch.get_rng_state()
    torch.set_rng_state(rng)
    try:
        return _C._rng_draw_box(kind, a, b, list(shape), list(box.offsets), list(box.sizes), into)
    finally:
        torch.set_rng_state(saved)


def _stream_whole(node: Node, shape, dtype, box: Box | None, into: torch.Tensor | None) -> None:
    """Draws the node's random sequence for a whole tensor of ``shape`` from its recorded
    generator state, chunk by chunk, copying the part in ``box`` into ``into``."""
    fill, extra, _ = random_fill(node)
    saved = torch.get_rng_state()
    torch.set_rng_state(node.rng)
    try:
        bounds = _chunks(math.prod(shape))
        buf = _scratch(max((b - a for a, b in bounds), default=0), dtype)
        for a, b in bounds:
            piece = buf[: b - a]
            fill(piece, extra)
            if box is None:
                continue
            pos = 0
            for fb in flat_range(tuple(shape), a, b):
                overlap = fb.intersect(box)
                if overlap is not None:
                    src = piece[pos:pos + fb.numel()].view(fb.sizes)
                    overlap.view_of(into, box).copy_(overlap.view_of(src, fb))
                pos += fb.numel()
        after = torch.get_rng_state()
    finally:
        torch.set_rng_state(saved)
    if box is None:
        torch.set_rng_state(after)  # recording: the generator moves on as the real op would move it


_scratch_buffers: dict[torch.dtype, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """One chunk buffer per dtype, kept: allocating and freeing one per tensor between the
    shards being kept fragments the heap, and resident memory grows by as much again."""
    buf = _scratch_buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _scratch_buffers[dtype] = torch.empty(max(numel, CHUNK + 16), dtype=dtype, device="cpu")
    return buf[:numel]


# ---- trunc_normal_, streamed ------------------------------------------------------------------

@dataclass(frozen=True)
class Truncated:
    mean: float
    std: float
    lo: float  # the bounds in the tensor's dtype, as torch compares them
    hi: float
    # bounds beyond 10 std (torchtitan's trunc_normal_(std=0.02) keeps a=-2, b=2): the CPU
    # Box-Muller never goes past 8.6 std (sqrt(-2 ln u) with u >= 2^-53), so nothing is
    # rejected and the init is one normal_ fill, drawn for the box only
    never_rejects: bool = False


def trunc_normal(node: Node) -> Truncated | None:
    """The parameters of a recorded ``trunc_normal_`` that can be streamed: torch 2.13's
    rejection sampler (whole-tensor ``normal_`` rounds, each element keeping its first
    draw inside [a, b]; the branch taken when [a, b] holds more than 30% of the mass) on a
    float32/float64 tensor of at least 16 elements that is its whole storage."""
    if not node.python or node.func.__name__ != "_no_grad_trunc_normal_" or not _trunc_normal_matches(node.func):
        return None
    bound = inspect.signature(node.func).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    t, mean, std, a, b = (bound.arguments[k] for k in ("tensor", "mean", "std", "a", "b"))
    if t.dtype not in (torch.float32, torch.float64) or t.numel() < 16 or not covers_storage(t):
        return None
    cdf = lambda x: (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0  # noqa: E731
    if cdf((b - mean) / std) - cdf((a - mean) / std) <= 0.3:
        return None  # torch's other branch (uniform proposals): replayed whole
    lo, hi = (torch.tensor(v, dtype=t.dtype, device="cpu").item() for v in (a, b))
    return Truncated(float(mean), float(std), lo, hi, (a - mean) / std < -10 and (b - mean) / std > 10)


def stream_trunc_normal(t: torch.Tensor, rng: torch.Tensor, p: Truncated, box: Box | None,
                        into: torch.Tensor | None) -> None:
    """Replays the rejection rounds chunk by chunk: a round is a whole-tensor normal_ (drawn
    in chunks, which give the same numbers), and the elements still outside [lo, hi] are
    kept as a bit per element; the box's elements take their first accepted draw. Memory:
    one chunk and n/8 bytes, not the tensor. Time: every round draws the whole tensor
    (chunks with nothing pending are skipped, not drawn). With no box (recording), only
    the generator moves: to where the real init leaves it. ``t``: the (meta) tensor the
    init filled; ``rng``: the generator state it started from."""
    shape, n = tuple(t.shape), t.numel()
    if p.never_rejects:  # (trunc_normal allows only fills whose draw is modelled)
        if not _draw_known(rng, "normal_", p.mean, p.std, shape, t.dtype, box, into):
            raise RuntimeError(f"vescale.deferred_init: the normal_ draw of a {t.dtype} trunc_normal_ of "
                               f"{n} elements is not modelled")
        return
    bounds = _chunks(n)
    longest = max(b - a for a, b in bounds)
    buf = _scratch(longest, t.dtype)
    rejected_buf, other_buf = (torch.empty(longest, dtype=torch.bool, device="cpu") for _ in range(2))
    pending: list[torch.Tensor | None] = [None] * len(bounds)  # packed bits; None: all accepted
    saved = torch.get_rng_state()
    torch.set_rng_state(rng)
    try:
        first = True
        while first or any(bits is not None for bits in pending):
            for i, (a, b) in enumerate(bounds):
                if not first and pending[i] is None:
                    _C._rng_skip("normal_", t.dtype, b - a)
                    continue
                piece = buf[: b - a].normal_(p.mean, p.std)
                still, take = rejected_buf[: b - a], other_buf[: b - a]
                torch.lt(piece, p.lo, out=still)
                still.logical_or_(torch.gt(piece, p.hi, out=take))
                if first:
                    take = None  # every element takes its first draw
                else:
                    _unpack_bits(pending[i], take)   # take: pending before this round
                    still.logical_and_(take)         # pending after it
                    take.logical_xor_(still)         # pending before, accepted now
                if box is not None:
                    _write_box(piece, take, shape, a, b, box, into)
                pending[i] = _pack_bits(still) if bool(still.any()) else None
            first = False
    finally:
        after = torch.get_rng_state()
        torch.set_rng_state(saved)
    if box is None:
        torch.set_rng_state(after)  # recording: the generator moves on as the real init moves it


def _write_box(piece: torch.Tensor, take: torch.Tensor | None, shape, a: int, b: int, box: Box,
               into: torch.Tensor) -> None:
    """Copies the elements of flat [a, b) that lie in ``box`` (only those in ``take``)."""
    pos = 0
    for fb in flat_range(shape, a, b):
        overlap = fb.intersect(box)
        if overlap is not None:
            src = overlap.view_of(piece[pos:pos + fb.numel()].view(fb.sizes), fb)
            dst = overlap.view_of(into, box)
            if take is None:
                dst.copy_(src)
            else:
                torch.where(overlap.view_of(take[pos:pos + fb.numel()].view(fb.sizes), fb), src, dst, out=dst)
        pos += fb.numel()


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bits (element j: bit j % 8 of byte j // 8)."""
    bits = torch.zeros((mask.numel() + 7) // 8, dtype=torch.uint8, device="cpu")
    for k in range(8):
        part = mask[k::8]
        bits[: part.numel()].bitwise_or_(part.to(torch.uint8).bitwise_left_shift_(k))
    return bits


def _unpack_bits(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for k in range(8):
        part = out[k::8]
        torch.ne(bits[: part.numel()].bitwise_and(1 << k), 0, out=part)
    return out


_trunc_check: list[bool] = []


def _trunc_normal_matches(real) -> bool:
    """Whether stream_trunc_normal gives the values and generator state of ``real``, this
    torch's trunc_normal_ sampler (checked once per process on a small case with several
    rounds): another torch version's sampler is then replayed whole, never streamed wrongly."""
    if not _trunc_check:
        saved = torch.get_rng_state()
        try:
            torch.manual_seed(1234)
            rng = torch.get_rng_state()
            expected = real(torch.empty(37, 29, device="cpu"), 0.1, 1.0, -1.1, 1.3)
            expected_state = torch.get_rng_state()
            meta = torch.empty(37, 29, device="meta")
            got = torch.empty(37, 29, device="cpu")
            p = Truncated(0.1, 1.0, -1.1, 1.3)
            stream_trunc_normal(meta, rng, p, whole((37, 29)), got)
            torch.set_rng_state(rng)
            stream_trunc_normal(meta, rng, p, None, None)
            _trunc_check.append(torch.equal(got, expected) and torch.equal(torch.get_rng_state(), expected_state))
        finally:
            torch.set_rng_state(saved)
    return _trunc_check[0]


def covers_storage(t: torch.Tensor) -> bool:
    """A tensor that is its whole storage, in row-major order."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())
