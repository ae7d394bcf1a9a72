"""Where an unmodified model is cut into pipeline stages.

The model's repeated blocks (the children of its largest ``nn.ModuleList`` or
``nn.Sequential``, e.g. ``model.layers``) are the candidate cuts. Everything else that
holds parameters is a *unit* too: a unit registered before the blocks (the embedding)
belongs to the first stage, one registered after them (final norm, LM head) to the last.
Modules without parameters (rotary tables, dropout) and the code of the forwards that
call the blocks are glue: every stage runs them, so masks, position ids and rotary tables
are recomputed where they are needed instead of crossing a cut. Parameters held directly
by the model or a module above the blocks are glue parameters: every stage holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.nn as nn


class PipelineSplitError(ValueError):
    """A model cannot be cut where asked; the message names the module and the fix."""


@dataclass
class Unit:
    name: str
    module: nn.Module
    block: int | None = None   # index among the blocks, None for the units around them
    before: bool = False       # a unit of the first stage (registered before the blocks)


@dataclass
class Layout:
    blocks_name: str                 # e.g. "model.layers"
    blocks: list[Unit]
    pre: list[Unit]                  # units of the first stage
    post: list[Unit]                 # units of the last stage
    glue_parameters: list[str] = field(default_factory=list)

    @property
    def units(self) -> list[Unit]:
        return self.pre + self.blocks + self.post

    def block_index(self, name: str) -> int:
        for u in self.blocks:
            if u.name == name:
                return u.block
        raise PipelineSplitError(
            f"split point {name!r} is not one of the model's blocks; split points name blocks of "
            f"{self.blocks_name!r}, e.g. {self.blocks[len(self.blocks) // 2].name!r}")


def find_layout(model: nn.Module, blocks: str | None = None) -> Layout:
    """The blocks (``blocks`` names their container, else the largest list of modules)
    and the units around them."""
    if blocks is None:
        blocks = _largest_block_list(model)
    try:
        container = model.get_submodule(blocks)
    except AttributeError:
        raise PipelineSplitError(f"the model has no module {blocks!r} to take the blocks from") from None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
        raise PipelineSplitError(f"{blocks!r} is a {type(container).__name__}, not a list of at least two blocks "
                                 f"(nn.ModuleList or nn.Sequential) to cut between")
    block_units = [Unit(f"{blocks}.{n}", m, block=i) for i, (n, m) in enumerate(container.named_children())]
    pre, post, glue = [], [], []
    path = blocks.split(".")
    owner, prefix = model, ""
    for step in path:  # down the modules that lead to the blocks
        glue += [prefix + n for n, _ in owner.named_parameters(recurse=False)]
        seen_path = False
        for name, child in owner.named_children():
            if name == step:
                seen_path = True
                continue
            if any(True for _ in child.parameters()):
                (post if seen_path else pre).append(Unit(prefix + name, child, before=not seen_path))
        owner, prefix = getattr(owner, step), prefix + step + "."
    return Layout(blocks, block_units, pre, post, glue)


def _largest_block_list(model: nn.Module) -> str:
    best, best_size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size or (size == best_size and best is not None and name.count(".") < best.count(".")):
                best, best_size = name, size
    if best is None:
        raise PipelineSplitError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks to cut "
                                 f"between; pass blocks='name.of.the.list'")
    return best


# ---- stage boundaries ----------------------------------------------------------------------

def assign_blocks(layout: Layout, stages: int, split: str | Sequence[str],
                  block_costs: Sequence[float] | None = None,
                  pre_cost: float = 0.0, post_cost: float = 0.0) -> list[tuple[int, int]]:
    """Per stage, its range [start, end) of blocks. ``split`` is a list of ``stages - 1``
    block names (each starts a stage), ``"uniform"`` (equal block counts), or, with
    ``block_costs``, a cost-balanced cut (the first stage also pays ``pre_cost``, the last
    ``post_cost``)."""
    n = len(layout.blocks)
    if stages < 1:
        raise PipelineSplitError(f"a pipeline needs at least one stage, got {stages}")
    if stages > n:
        raise PipelineSplitError(f"{stages} stages cannot be cut from {n} blocks of {layout.blocks_name!r}: "
                                 f"every stage needs at least one block; use at most {n} stages")
    if isinstance(split, str):
        if split == "uniform":
            starts = [round(s * n / stages) for s in range(stages)]
        elif block_costs is None:
            raise PipelineSplitError(f"unknown split method {split!r}; use 'uniform', 'parameters', 'flops', "
                                     f"'time' or a list of {stages - 1} block names")
        else:
            starts = balanced_starts(block_costs, stages, pre_cost, post_cost)
    else:
        names = list(split)
        if len(names) != stages - 1:
            raise PipelineSplitError(f"{stages} stages need {stages - 1} split points, got {len(names)}: {names}")
        starts = [0] + [layout.block_index(x) for x in names]
        for a, b, name in zip(starts, starts[1:], names):
            if b <= a:
                raise PipelineSplitError(
                    f"split point {name!r} leaves a stage with no blocks (it does not come after the previous "
                    f"split point); split points must name blocks in increasing order, each stage at least one")
    return [(a, b) for a, b in zip(starts, starts[1:] + [n])]


def balanced_starts(costs: Sequence[float], stages: int, pre: float, post: float) -> list[int]:
    """The contiguous cut of ``costs`` into ``stages`` non-empty parts with the smallest
    largest part (dynamic programming; blocks are few)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def part(s: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (pre if s == 0 else 0.0) + (post if s == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][b]: first s stages over blocks [0, b)
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n - (stages - s) + 1):
            for a in range(s - 1, b):
                value = max(best[s - 1][a], part(s - 1, a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    starts, b = [], n
    for s in range(stages, 0, -1):
        b = cut[s][b]
        starts.append(b)
    return starts[::-1]
