"""Tensor-parallel sharding chosen by what-if runs (``virtual``): per cluster of identical
blocks, per sub-module that holds linear layers (a *region*: attention, MLP), every
assignment of ``Shard(out)``, ``Shard(in)`` (and ``InterleavedShard`` for outputs the model
splits into equal pieces) to its linear layers is run over a virtual mesh with the
region's input and output in the residual stream's placement, and the one whose
collectives cost least (alpha-beta of the backend at hand) wins: Megatron's column/row
pairs come out of the rules' costs, not from a table. The token embedding and the head
take their cheaper split the same way, on the whole model.

``tensor_parallel_plan`` decides once whether these runs take real local tensors or meta
ones (``TPChoice.real_what_ifs``), from the model's forward on meta against its profiled
real step.
"""

from __future__ import annotations

import copy
import itertools
import re
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import _C
from ..dtensor import DTensor
from ..parallel.parallelize import parallelize_module
from ..placement_types import InterleavedShard, Placement, Replicate, Shard, to_c
from .calling import call_model, slice_batch, without_cache
from .commfit import CommModel
from .profile import Profile
from .scalars import replays_profile
from .structure import Linear
from .virtual import Recorder, VirtualMesh, cheaper_on_real_tensors, meta_copy, placement_cost, what_if_batch, what_if_run
from .whatif import UnitCollectives, unit_collectives

__all__ = ["tensor_parallel_plan", "TPChoice", "RegionResult"]

R = Replicate()
_DEBUG = False

# ---- regions and candidates ----------------------------------------------------------------------

@dataclass
class Region:
    name: str                  # FQN in the representative block, e.g. "transformer.h.0.attn"
    linears: list[Linear]


def _regions(block_name: str, block: nn.Module, linears: list[Linear]) -> list[Region]:
    """Direct children of a block that hold linear layers; the block itself when its
    linears are direct children."""
    mine = [lin for lin in linears if lin.name.startswith(block_name + ".") and not lin.embedding]
    out: dict[str, Region] = {}
    for lin in mine:
        rest = lin.name[len(block_name) + 1:]
        child = rest.split(".")[0]
        name = f"{block_name}.{child}" if "." in rest else block_name
        out.setdefault(name, Region(name, [])).linears.append(lin)
    if block_name in out and len(out) > 1:  # linears directly in the block and in children: one region
        return [Region(block_name, mine)]
    return list(out.values())


def _candidates(lin: Linear, tp: int) -> list[Placement]:
    o, shape = lin.out_dim, lin.shape
    i = 1 - o
    out = []
    if shape[o] % tp == 0 and shape[o] >= tp:
        out.append(Shard(o))
    if lin.fused > 1 and shape[o] % (lin.fused * tp) == 0:
        out.append(InterleavedShard(o, lin.fused))
    if shape[i] % tp == 0 and shape[i] >= tp:
        out.append(Shard(i))
    return out


def _bias_placement(lin: Linear, w: Placement) -> Placement | None:
    if lin.bias is None:
        return None
    if isinstance(w, InterleavedShard) and w.dim == lin.out_dim:
        return InterleavedShard(0, w.groups)
    if isinstance(w, Shard) and w.dim == lin.out_dim:
        return Shard(0)
    return R


def _splits_output(lin: Linear, w: Placement) -> bool:
    return w.splits() and w.dim == lin.out_dim


def _param_rules(lins_and_placements, rename) -> dict:
    rules = {}
    for lin, w in lins_and_placements:
        rules[rename(lin.weight)] = [w]
        b = _bias_placement(lin, w)
        if b is not None and b != R:
            rules[rename(lin.bias)] = [b]
    return rules


def _stream(sp: bool) -> Placement:
    return Shard(1) if sp else R


def _as_stream(x: torch.Tensor, mesh, placement: Placement, real: bool = False) -> DTensor:
    """A DTensor of x's shape and dtype (meta, or zeros on the CPU: ``real``), laid out as
    ``placement``."""
    shape = list(x.shape)
    local, _ = _C.local_shape(shape, to_c([placement]), list(mesh.shape), list(mesh.get_coordinate()))
    t = torch.zeros(local, dtype=x.dtype) if real else torch.empty(local, dtype=x.dtype, device="meta")
    return DTensor.from_local(t, mesh, [placement], shape=shape, stride=list(x.stride())).requires_grad_(
        x.requires_grad)


def _capture_inputs(model: nn.Module, batch, names: set[str], real: bool = False) -> dict[str, tuple]:
    """(args, kwargs) each named module receives first, on a meta copy of the model (or on
    the model itself: ``real``; values detached)."""
    got: dict[str, tuple] = {}
    handles = []
    for n, m in model.named_modules():
        if n in names:
            def pre(mod, args, kwargs, n=n):
                if n not in got:
                    args, kwargs = tree_map(_detached, (list(args), dict(kwargs)))
                    got[n] = tuple(without_cache(args, kwargs))
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with what_if_run(real):
            call_model(model, what_if_batch(batch, real))
    finally:
        for h in handles:
            h.remove()
    return got


def _detached(x):
    """A captured input cut from the run's graph (still saying whether it needed a gradient)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.grad_fn is not None:
        return x.detach().requires_grad_(x.requires_grad)
    return x


@dataclass
class RegionResult:
    region: str
    assignment: list                 # [(Linear, weight placement)]
    cost_s: float
    events: list
    tried: int
    runner_up: tuple | None = None   # (placements, cost) of the second best
    failed: int = 0
    stream_argument: int | str = 0   # where the residual stream enters (a position or a keyword)


def _stream_argument(inputs: tuple):
    """Where the residual stream enters a region: a position or a keyword."""
    args, kwargs = inputs
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point():
            return i
    for k, a in kwargs.items():
        if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point():
            return k
    return 0


def _input_spec(where, placement):
    """A forward-plan input entry that moves one argument (a position or a keyword)."""
    if isinstance(where, str):
        return {where: [placement]}
    return [None] * where + [[placement]]


def _run_region(region_mod: nn.Module, inputs: tuple, assignment, mesh, sp: bool, rel_name, real: bool) -> list:
    """Events of one region's forward and backward under ``assignment`` [(Linear, placement)]."""
    holder = nn.ModuleDict({"r": copy.deepcopy(region_mod)})
    stream = _stream(sp)
    plan = {"parameter": _param_rules(assignment, lambda n: "r." + rel_name(n)),
            "forward": {r"r\.output": [[stream]]}}
    # the stream enters replicated (gathered once there under SP); in the backward this is
    # where its gradient is summed, once for the region (Megatron's f and g operators)
    plan["forward"][r"r\.input"] = _input_spec(_stream_argument(inputs), R)
    with what_if_run(real):
        parallelize_module(holder, mesh, plan)
        args, kwargs = inputs

        def lay_out(x):
            if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
                return _as_stream(x, mesh, stream, real)
            return x
        args, kwargs = tree_map(lay_out, args), tree_map(lay_out, kwargs)
        with Recorder() as rec:
            out = holder["r"](*args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, DTensor) and t.requires_grad]
            grads = [_as_stream(torch.empty(o.shape, dtype=o.dtype, device="meta"), mesh, o.placements[0], real)
                     for o in outs]
            torch.autograd.backward(outs, grads)
    return rec.events


@replays_profile
def tensor_parallel_plan(profile: Profile, model: nn.Module, batch, tp: int, comm: CommModel, *,
                         sequence_parallel: bool = False, real: bool | None = None) -> "TPChoice":
    """The tensor-parallel sharding plan of least communication for ``tp`` ranks, found by
    what-if runs (see the module docstring). ``real``: run them on real local tensors
    (True) or on meta (False); by default, whichever is cheaper for this model."""
    start = time.perf_counter()
    meta = meta_copy(model)
    mesh = VirtualMesh([tp], ["TP"])
    clusters = profile.clusters()
    block_regions: list[tuple[list, list[Region]]] = []
    wanted = set()
    for cluster in clusters:
        rep = cluster[0]
        regions = _regions(rep.name, meta.get_submodule(rep.name), profile.linears)
        block_regions.append((cluster, regions))
        wanted |= {r.name for r in regions}
    small = slice_batch(batch, profile.measured_at[0])
    captured = time.perf_counter()
    inputs = _capture_inputs(meta, small, wanted)
    if real is None:
        real = cheaper_on_real_tensors(profile, model, time.perf_counter() - captured)
    if real:  # the regions' inputs with values
        inputs = _capture_inputs(model, small, wanted, real=True)
    source = model if real else meta
    results: list[RegionResult] = []
    problems: list[str] = []
    for cluster, regions in block_regions:
        for region in regions:
            if region.name not in inputs:
                problems.append(f"{region.name} did not run")
                continue
            options = [_candidates(lin, tp) for lin in region.linears]
            if any(not o for o in options):
                bad = [lin.name for lin, o in zip(region.linears, options) if not o]
                problems.append(f"{region.name}: {bad} cannot be split {tp} ways")
                continue
            region_mod = source.get_submodule(region.name)
            prefix = region.name + "."
            scored = []
            failed = 0
            for combo in itertools.product(*options):
                assignment = list(zip(region.linears, combo))
                try:
                    events = _run_region(region_mod, inputs[region.name], assignment, mesh, sequence_parallel,
                                         lambda n, p=prefix: n[len(p):], real)
                except Exception:  # noqa: BLE001  (a layout the rules cannot run: not a candidate)
                    failed += 1
                    if _DEBUG:
                        import traceback
                        traceback.print_exc()
                    continue
                cost = placement_cost(events, comm)
                if _DEBUG:
                    print("LAYOUT", region.name, combo, events)
                scored.append((cost, sum(b for _, _, b in events), len(events), len(scored), combo, events))
            if not scored:
                problems.append(f"{region.name}: no split of its linear layers runs")
                continue
            scored.sort(key=lambda s: s[:4])
            best = scored[0]
            res = RegionResult(region.name, list(zip(region.linears, best[4])), best[0], best[5],
                               len(scored) + failed, failed=failed, stream_argument=_stream_argument(inputs[region.name]))
            if len(scored) > 1:
                res.runner_up = ({lin.name: p for lin, p in zip(region.linears, scored[1][4])}, scored[1][0])
            results.append(res)
    choice = TPChoice(tp=tp, sequence_parallel=sequence_parallel, blocks=profile.blocks, regions=results,
                      problems=problems, real_what_ifs=real)
    choice.clusters = [[u.name for u in cluster] for cluster, _ in block_regions]
    _choose_ends(choice, profile, source, small, comm)
    choice.seconds = time.perf_counter() - start
    return choice


# ---- the embedding and the head ------------------------------------------------------------------

def _token_embeddings(profile: Profile) -> tuple[list[Linear], list[Linear]]:
    """(token embeddings, heads): embeddings of the first stage's units whose rows are the
    vocabulary (the head's output size, or tied with it), and the last stage's linears."""
    post = {u.name for u in profile.units if u.kind == "post"}
    pre = {u.name for u in profile.units if u.kind == "pre"}

    def unit_of(name, units):
        return any(name == u or name.startswith(u + ".") for u in units)
    heads = [lin for lin in profile.linears if not lin.embedding and unit_of(lin.name, post)]
    embs = [lin for lin in profile.linears if lin.embedding and unit_of(lin.name, pre)]
    vocab = {lin.shape[lin.out_dim] for lin in heads}
    tied = {n for group in profile.tied for n in group}
    tokens = [e for e in embs if e.shape[0] in vocab or e.weight in tied]
    if not tokens and embs:
        tokens = [max(embs, key=lambda e: e.shape[0] * e.shape[1])]
    return tokens, heads


def _choose_ends(choice: "TPChoice", profile: Profile, model: nn.Module, batch, comm: CommModel) -> None:
    """The token embeddings' and the head's split (rows or columns), by the whole model's
    collectives: how the head is split changes how every block's backward runs."""
    tokens, heads = _token_embeddings(profile)
    tp = choice.tp
    options = [(lin, [p for p in (Shard(0), Shard(1)) if lin.shape[p.dim] % tp == 0 and lin.shape[p.dim] >= tp])
               for lin in tokens + heads]
    options = [(lin, c) for lin, c in options if c]
    choice.end_modules = {lin.weight: lin for lin, _ in options}
    # tied weights are one tensor: one choice for the group
    groups: list[list[Linear]] = []
    for lin, _ in options:
        tied = next((set(g) for g in profile.tied if lin.weight in g), {lin.weight})
        group = next((g for g in groups if g[0].weight in tied), None)
        if group is None:
            groups.append([lin])
        else:
            group.append(lin)
    cands = {lin.weight: c for lin, c in options}
    per_group = [[d for d in (0, 1) if all(Shard(d) in cands[x.weight] for x in g)] for g in groups]
    best = None
    for combo in itertools.product(*per_group):
        assignment = {x.weight: Shard(d) for g, d in zip(groups, combo) for x in g}
        try:
            collectives = unit_collectives(profile, model, batch, choice.plan(ends=assignment), tp,
                                           choice.sequence_parallel, real=choice.real_what_ifs)
        except Exception as e:  # noqa: BLE001
            choice.problems.append(f"ends {assignment}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        cost = placement_cost(collectives.events, comm)
        if best is None or cost < best[0]:
            best = (cost, assignment, collectives)
    choice.ends = best[1] if best else {}
    choice.small_batch_collectives = best[2] if best else None


@dataclass
class TPChoice:
    """A tensor-parallel plan found by what-if runs."""

    tp: int
    sequence_parallel: bool
    blocks: str
    regions: list[RegionResult]
    problems: list[str] = field(default_factory=list)
    clusters: list = field(default_factory=list)
    ends: dict = field(default_factory=dict)          # weight FQN -> placement (token embeddings, head)
    end_modules: dict = field(default_factory=dict)
    seconds: float = 0.0
    real_what_ifs: bool = False  # what-ifs on real local tensors (cheaper here than on meta)
    # unit_collectives of plan() at the profile's smaller batch size (the ends' choice ran it)
    small_batch_collectives: "UnitCollectives | None" = None

    @property
    def feasible(self) -> bool:
        return not self.problems

    def _block_pattern(self, name: str, cluster: list[str]) -> str:
        """``name`` (under the cluster's first block) as a pattern over all its blocks."""
        first = cluster[0]
        rest = name[len(first):]
        indices = [c[len(self.blocks) + 1:] for c in cluster]
        idx = r"\d+" if len(self.clusters) == 1 else "(" + "|".join(indices) + ")"
        return re.escape(self.blocks) + r"\." + idx + re.escape(rest)

    @property
    def placements(self) -> dict:
        """{linear FQN (in the first block of its cluster): weight placement}."""
        return {lin.name: p for res in self.regions for lin, p in res.assignment}

    def plan(self, ends: dict | None = None) -> dict:
        """The sharding plan (``tensor_parallel.sharding_plan``) for every block and the ends."""
        ends = self.ends if ends is None else ends
        stream = _stream(self.sequence_parallel)
        parameter, forward = {}, {}
        for res in self.regions:
            cluster = next(c for c in self.clusters if res.region.startswith(c[0] + ".") or res.region == c[0])
            for lin, w in res.assignment:
                parameter[self._block_pattern(lin.weight, cluster)] = [w]
                b = _bias_placement(lin, w)
                if b is not None and b != R:
                    parameter[self._block_pattern(lin.bias, cluster)] = [b]
            if res.region != cluster[0]:
                forward[self._block_pattern(res.region, cluster) + r"\.input"] = _input_spec(res.stream_argument, R)
                forward[self._block_pattern(res.region, cluster) + r"\.output"] = [[stream]]
        for weight, p in ends.items():
            lin = self.end_modules[weight]
            parameter[re.escape(weight)] = [p]
            if lin.embedding:
                forward[re.escape(lin.name) + r"\.output"] = [[stream]]
            elif self.sequence_parallel and _splits_output(lin, p):
                forward[re.escape(lin.name) + r"\.input"] = [[R]]
        return {"parameter": parameter, "forward": forward}

    def describe(self) -> str:
        lines = [f"tensor parallelism over {self.tp} ranks{' with sequence parallelism' if self.sequence_parallel else ''}"
                 f" (found by what-if runs in {self.seconds:.2f} s):"]
        for res in self.regions:
            ps = ", ".join(f"{lin.name.rsplit('.', 1)[-1]} {_short(p)}" for lin, p in res.assignment)
            lines.append(f"  {res.region}: {ps}; {len(res.events)} collectives, {1e3 * res.cost_s:.2f} ms per step "
                         f"({res.tried} layouts tried)")
            if res.runner_up:
                ps2 = ", ".join(f"{n.rsplit('.', 1)[-1]} {_short(p)}" for n, p in res.runner_up[0].items())
                lines.append(f"    next best: {ps2}: {1e3 * res.runner_up[1]:.2f} ms")
        for w, p in self.ends.items():
            lines.append(f"  {w}: {_short(p)}")
        for p in self.problems:
            lines.append(f"  problem: {p}")
        return "\n".join(lines)


def _short(p: Placement) -> str:
    if isinstance(p, InterleavedShard):
        return f"InterleavedShard({p.dim}, {p.groups})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    return str(p)


