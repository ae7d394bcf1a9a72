"""Random chains of ops, run on plain tensors and on DTensors, compared in float64.

A program is plain data (so it travels to the ranks and into a regression test as a
literal): the mesh, the inputs (shape, seed, placements, whether it requires grad) and
the steps (op name, indices of the values it consumes, parameters). Every rank runs the
same program, so ranks never disagree about what to do; only the engine can make them.

The generator draws a step, runs it on plain tensors, and keeps it only if torch
accepts it: every program is one that plain torch runs, so any exception on the DTensor
side is a finding. Fresh tensors inside a step (weights, indices) get their placements
from their seed, the same way on every rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .ops import OPS, OPS_BY_NAME

# 2d14: a mesh dim of one rank; 1d3 and 2d23 (campaigns with --world 3 or 6): odd splits
MESHES = {"1d4": (4,), "2d": (2, 2), "1d2": (2,), "2d14": (1, 4), "1d3": (3,), "2d23": (2, 3)}
SIZES = [0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 9]


@dataclass
class Program:
    mesh: str
    inputs: list = field(default_factory=list)   # (shape, seed, placements, requires_grad)
    steps: list = field(default_factory=list)    # (op name, value indices, params)
    # "grad": forward and backward; "inference": the steps run under torch.inference_mode()
    # (inputs made outside it), values compared, no backward; "train.<optimizer>.<zeroing>":
    # two rounds of forward, backward and an optimizer step over the inputs (rank.py)
    mode: str = "grad"

    def to_literal(self) -> tuple:
        lit = (self.mesh, [tuple(i) for i in self.inputs], [tuple(s) for s in self.steps])
        return lit if self.mode == "grad" else (*lit, self.mode)

    @staticmethod
    def from_literal(lit) -> "Program":
        mesh, inputs, steps, *mode = lit
        return Program(mesh, [list(i) for i in inputs], [list(s) for s in steps], *mode)

    def describe(self) -> str:
        lines = [f"mesh {self.mesh}" + (f", {self.mode} mode" if self.mode != "grad" else "")]
        for k, (shape, _, placements, grad) in enumerate(self.inputs):
            lines.append(f"v{k} = input{tuple(shape)} {placements}{' requires_grad' if grad else ''}")
        n = len(self.inputs)
        for k, (name, args, params) in enumerate(self.steps):
            shown = {p: v for p, v in params.items() if p not in ("fresh",)}
            lines.append(f"v{n + k} = {name}({', '.join(f'v{a}' for a in args)}{', ' if shown else ''}"
                         f"{', '.join(f'{p}={v!r}' for p, v in shown.items())})")
        return "\n".join(lines)


# ---- placements ------------------------------------------------------------------------------

def draw_placements(rng: random.Random, shape, mesh_shape, *, partial: bool = True) -> list[str]:
    """Placements as strings ("R", "S0", "P.sum", "I1.3" for InterleavedShard(1, 3)), so
    that programs are plain data. A split is interleaved half of the time where the
    dim divides into groups x ranks pieces and no other mesh dim splits it."""
    ndim = len(shape)
    out = []
    for k in mesh_shape:
        r = rng.random()
        if ndim and r < 0.5:
            d = rng.randrange(ndim)
            fits = [g for g in (2, 3) if shape[d] > 0 and shape[d] % (g * k) == 0]
            interleave = rng.random() < 1 / 2 and fits
            out.append(f"I{d}.{rng.choice(fits)}" if interleave else f"S{d}")
        elif partial and r < 0.75:
            out.append(rng.choice(["P.sum", "P.sum", "P.sum", "P.avg", "P.max"]))
        else:
            out.append("R")
    split_dims = [c[1:].split(".")[0] for c in out if c[0] in "SI"]
    return [f"S{c[1:].split('.')[0]}" if c[0] == "I" and split_dims.count(c[1:].split(".")[0]) > 1 else c
            for c in out]


def placements_from_codes(codes: list[str]) -> list:
    from vescale import InterleavedShard, Partial, Replicate, Shard
    return [Replicate() if c == "R" else Shard(int(c[1:])) if c.startswith("S") else
            InterleavedShard(*map(int, c[1:].split("."))) if c.startswith("I") else Partial(c.split(".")[1])
            for c in codes]


def fresh_placements(seed: int, shape, mesh: str, *, partial: bool) -> list[str]:
    return draw_placements(random.Random(seed * 7919 + 1), shape, MESHES[mesh], partial=partial)


# ---- tensors -------------------------------------------------------------------------------

def full_value(shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def index_value(shape, seed: int, high: int) -> torch.Tensor:
    if high <= 0:
        return torch.zeros(tuple(shape), dtype=torch.long)
    return torch.randint(0, high, tuple(shape), generator=torch.Generator().manual_seed(seed))


class PlainFactory:
    """Fresh tensors for the single-device reference."""

    def input(self, shape, seed, placements, requires_grad) -> torch.Tensor:
        return full_value(shape, seed).requires_grad_(requires_grad)

    def new(self, kind, shape, seed, high=None) -> torch.Tensor:
        return index_value(shape, seed, high) if kind == "index" else full_value(shape, seed)


# ---- running ----------------------------------------------------------------------------------

def run_step(values: list, factory, name: str, args, params: dict):
    op = OPS_BY_NAME[name]
    kwargs = dict(params)
    if "fresh" in kwargs:
        kwargs["new"] = factory.new
    else:
        kwargs.pop("fresh", None)
    return op.run(*[values[a] for a in args], **kwargs)


def run_program(program: Program, factory) -> tuple[list, list]:
    """The inputs and every value the steps produce (forward only)."""
    inputs = [factory.input(*spec) for spec in program.inputs]
    values = list(inputs)
    with torch.inference_mode(program.mode == "inference"):
        for name, args, params in program.steps:
            values.append(run_step(values, factory, name, args, params))
    return inputs, values


def loss_of(values: list, factory_new, n_inputs: int):
    """A weighted sum of the last value that carries a gradient (None when none does);
    the weights make a wrong gradient layout visible where a plain sum would not."""
    for k in range(len(values) - 1, n_inputs - 1, -1):
        v = values[k]
        if v.requires_grad and v.is_floating_point():
            return (v * factory_new("weight", tuple(v.shape), 991 + k)).sum()
    return None


# ---- generating ---------------------------------------------------------------------------------

def draw_shape(rng: random.Random) -> list[int]:
    return [rng.choice(SIZES) if rng.random() < 0.8 else rng.choice([1, 4, 6, 8, 12]) for _ in range(rng.choice([1, 2, 2, 3, 3, 4]))]


def generate(rng: random.Random, mesh: str | None = None, max_steps: int = 6, boost: tuple[str, ...] = ()) -> Program:
    """A program of 2..max_steps steps that plain torch runs without error; the ops named
    in `boost` are drawn 10 times as often (to aim a campaign at new table rows)."""
    mesh = mesh or rng.choice(["1d4", "2d"])
    program = Program(mesh)
    factory = PlainFactory()
    values = []
    for k in range(rng.choice([1, 1, 2])):
        shape = draw_shape(rng)
        spec = [shape, rng.randrange(1 << 20), draw_placements(rng, shape, MESHES[mesh]),
                rng.random() < 0.8]
        program.inputs.append(spec)
        values.append(factory.input(*spec))
    target = rng.randint(2, max_steps)
    weights = [op.weight * (10 if op.name in boost else 1) for op in OPS]
    attempts = 0
    while len(program.steps) < target and attempts < 200:
        attempts += 1
        op = rng.choices(OPS, weights)[0]
        try:
            drawn = op.draw(rng, values)
        except RuntimeError:  # e.g. reading autograd facts of a view torch has invalidated
            continue
        if drawn is None:
            continue
        args, params = drawn
        if "fresh" in params:
            params = {**params, "fresh": True}
        trial = _try(values, factory, op.name, args, params)
        if trial is None:
            continue
        values = trial
        program.steps.append([op.name, tuple(args), params])
    return program


# The ops that bring NaN and +-inf into a chain on purpose (ops.py's seventh table);
# elsewhere a non-finite value is an accident of the drawn numbers, not a case to test.
NON_FINITE_SOURCES = frozenset({"poison", "poison_", "masked_softmax", "masked_log_softmax"})


def _may_be_non_finite(values: list, name: str, args) -> bool:
    return name in NON_FINITE_SOURCES or any(
        values[a].is_floating_point() and not torch.isfinite(values[a]).all() for a in args)


def _try(values: list, factory, name, args, params) -> list | None:
    """The values after the step, or None if torch refuses it (forward or backward) or
    it yields something a chain should not hold. Runs on clones, so a refused in-place
    step leaves the chain as it was."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # What torch only still allows with a deprecation warning (writing into an
            # expanded tensor, where elements share memory) is not part of the contract.
            warnings.filterwarnings("error", message=".*deprecated.*")
            out = run_step(values, factory, name, args, params)
            if not isinstance(out, torch.Tensor) or out.numel() > 4096 or out.dim() > 5:
                return None
            if out.is_floating_point() and not torch.isfinite(out).all() and not _may_be_non_finite(values, name, args):
                return None
    except (RuntimeError, ValueError, IndexError, TypeError, UserWarning):
        return None
    return values + [out]
