"""What-if runs: the model on ``meta`` tensors (no data, no compute) over a *virtual*
mesh whose process groups are torch's fake process group, through vescale's real
dispatcher and sharding rules, with the collective recorder on. What the engine would
send for a candidate plan (kind, group size, bytes) and what each rank would hold are
read off, without the hardware and without a graph of the model.

The virtual mesh lives beside the real world: its groups are fake ``ProcessGroup`` s
registered under names of their own (``vescale_whatif_*``), so what-if runs happen in
the ranks that will train, while their real (gloo) groups stay untouched, and need no
``torch.distributed`` at all. The same machinery with real local tensors (``real=True``)
times the local compute of a sharded model at its sharded shapes (the collectives do
nothing): how long a tensor-parallel rank computes, dispatcher overhead included.

On meta, device-dependent choices are made as on the mesh's device: scaled dot-product
attention takes the kernel the CPU would (the meta device has none but the math one,
which would issue different ops).

What-ifs (the regions' layouts, the ends' choice, the collectives per unit, what a split
backward keeps) run on real local tensors instead where that is cheaper: meta tensors take torch's
Python meta kernels, op by op, whatever the shapes, so for a small model a real step at
the sharded shapes (the fake collectives leave their outputs unwritten; nothing reads
them) costs less than the same step on meta. ``tensor_parallel_plan`` decides once
(``TPChoice.real_what_ifs``), from the model's forward on meta against its profiled real
step; both give the same collectives (tests/python/test_autoplan.py).

Tensor-parallel sharding is chosen here (``tensor_parallel_plan``): per cluster of
identical blocks, per sub-module that holds linear layers (a *region*: attention, MLP),
every assignment of ``Shard(out)``, ``Shard(in)`` (and ``InterleavedShard`` for outputs
the model splits into equal pieces) to its linear layers is run on meta with the region's
input and output in the residual stream's placement, and the one whose collectives cost
least (alpha-beta of the backend at hand) wins: Megatron's column/row pairs come out of
the rules' costs, not from a table. The token embedding and the head take their cheaper
split the same way, on the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import _C
from ..device_mesh import DeviceMesh
from ..dtensor import DTensor
from ..parallel import parallelize as _parallelize
from ..parallel.parallelize import parallelize_module
from ..parallel.pipeline.split import find_layout
from ..parallel.tp_grads import partial_gradients_of
from ..placement_types import InterleavedShard, Placement, Replicate, Shard, to_c
from .calling import call_model, loss_of, slice_batch, without_cache
from .commfit import CommModel
from .profile import Profile
from .scalars import replay_mode, replays_profile
from .structure import Linear
from .timing import median_times, saved_per_unit

__all__ = ["VirtualMesh", "what_if", "meta_copy", "tensor_parallel_plan", "unit_collectives", "TPChoice",
           "sharded_times", "sharded_saved", "placement_cost"]

R = Replicate()
_DEBUG = False

# ---- a mesh of fake process groups ---------------------------------------------------------------

_groups: dict[tuple[int, int], object] = {}


def _fake_group(size: int, rank: int):
    key = (size, rank)
    if key not in _groups:
        from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup, _register_process_group

        import torch.distributed as dist

        backend = FakeProcessGroup._create_internal(rank, size)
        pg = ProcessGroup(dist.HashStore(), rank, size)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
        name = f"vescale_whatif_{size}_{rank}"
        pg._set_group_name(name)
        _register_process_group(name, pg)
        _groups[key] = pg
    return _groups[key]


class _FakeTorchMesh:
    def __init__(self, groups, coordinate):
        self.groups, self.coordinate = groups, list(coordinate)

    def get_coordinate(self):
        return self.coordinate

    def get_group(self, i=0):
        return self.groups[i]


class VirtualMesh(DeviceMesh):
    """A DeviceMesh of ``shape`` seen from ``coordinate`` (default: all zeros), over fake
    process groups: collectives do nothing (the recorder still sees them)."""

    def __init__(self, shape, names, coordinate=None):
        shape = tuple(int(s) for s in shape)
        coordinate = list(coordinate or [0] * len(shape))
        n = 1
        for s in shape:
            n *= s
        groups = [_fake_group(s, c) for s, c in zip(shape, coordinate)]
        self._torch = _FakeTorchMesh(groups, coordinate)
        self._device_type = "cpu"
        self._ranks = torch.arange(n).reshape(shape)
        self._names = tuple(names)
        self._c = _C.Mesh(list(shape), self._ranks.flatten().tolist(), list(self._names),
                          [g.group_name for g in groups], coordinate, "cpu")

    def get_rank(self) -> int:
        return int(self._ranks[tuple(self._torch.coordinate)])

    def __getitem__(self, names):
        key = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim(n) for n in key]
        return VirtualMesh([self.shape[d] for d in dims], key, [self._torch.coordinate[d] for d in dims])


# ---- meta runs -------------------------------------------------------------------------------------

def _stand_in(t):
    if t is None:
        return None
    strides = [0] * (t.dim() - 1) + [1] if t.dim() else []
    return torch.empty(t.shape[-1:] or [1], dtype=t.dtype).as_strided(t.shape, strides)


_sdpa = F.scaled_dot_product_attention


def _meta_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention on meta takes the kernel the CPU would take (the choice reads only shapes)."""
    if q.is_meta and isinstance(q, torch.Tensor):
        try:
            with _disable_current_modes():  # the choice is not the model's work: no mode records it
                choice = torch._fused_sdp_choice(_stand_in(q), _stand_in(k), _stand_in(v), _stand_in(attn_mask),
                                                 dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        except RuntimeError as e:
            if _DEBUG:
                print("SDPA choice failed", e)
            choice = 0
        if _DEBUG:
            print("SDPA", type(q).__name__, tuple(q.shape), q.stride(), None if attn_mask is None else tuple(attn_mask.shape), is_causal, scale, choice)
        if choice == 1:  # the CPU flash kernel (it takes fewer key/value heads as they are)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    if enable_gqa:
        return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


class _PlainMetaAsReplicated(TorchFunctionMode):
    """A plain meta tensor that meets a DTensor is taken as replicated, as the engine takes
    a plain CPU tensor. (Left plain, it would not reach the engine at all: the meta
    device's dispatch key outranks vescale's, so the meta kernel would run on the
    DTensor and no rule would be asked.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _shallow_leaves(args, kwargs)
        if leaves is None:
            leaves = tree_flatten((args, kwargs))[0]
        mesh = next((t.device_mesh for t in leaves if isinstance(t, DTensor)), None)
        if mesh is not None and any(_plain_meta(t) for t in leaves):
            flat, spec = tree_flatten((args, kwargs))
            reps = [R] * mesh.ndim
            flat = [DTensor.from_local(t, mesh, reps) if _plain_meta(t) else t for t in flat]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


def _shallow_leaves(args, kwargs) -> list | None:
    """The arguments, lists and tuples among them opened once; None where they nest
    deeper (pytree then). Most calls pass tensors and scalars, and pytree's flattening of
    every call showed among a meta what-if's largest Python costs in cProfile."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            if any(isinstance(b, (list, tuple, dict)) for b in a):
                return None
            out.extend(a)
        elif isinstance(a, dict):
            return None
        else:
            out.append(a)
    return out


def _plain_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_meta and t.dim() > 0


@contextlib.contextmanager
def what_if(meta: bool = True):
    """While open: parallelize_module turns meta parameters into meta shards and its hooks
    move meta DTensors; plain meta tensors that meet DTensors are replicated; attention on
    meta picks the CPU's kernel; values read out of meta tensors are the profile's
    (vescale.autoplan.scalars, inside tensor_parallel_plan and unit_collectives)."""
    old = _parallelize._WHAT_IF[0]
    _parallelize._WHAT_IF[0] = meta
    F.scaled_dot_product_attention = _meta_sdpa
    mode = _PlainMetaAsReplicated() if meta else contextlib.nullcontext()
    try:
        with mode, replay_mode() if meta else contextlib.nullcontext():
            yield
    finally:
        F.scaled_dot_product_attention = _sdpa
        _parallelize._WHAT_IF[0] = old


@contextlib.contextmanager
def what_if_run(real: bool):
    """A what-if run on meta, or on real local tensors (denormals flushed: what the fake
    collectives leave in their outputs is arbitrary, and denormal arithmetic is slow)."""
    if not real:
        with what_if():
            yield
        return
    torch.set_flush_denormal(True)
    try:
        with what_if(meta=False):
            yield
    finally:
        torch.set_flush_denormal(False)


def what_if_copy(model: nn.Module, real: bool) -> nn.Module:
    """The copy a what-if run parallelizes: real (``real``) or on meta."""
    return copy.deepcopy(model) if real else meta_copy(model)


def what_if_batch(batch, real: bool):
    """The batch a what-if run takes: as it is (``real``) or as meta tensors."""
    return batch if real else tree_map(_meta, batch)


def _cheaper_on_real_tensors(profile: Profile, model: nn.Module, meta_forward_s: float) -> bool:
    """Whether a whole-model what-if costs less on real tensors: the profiled real step at
    the smaller batch (forward and backward, unsharded: an upper bound) against the same
    step on meta, about three times its forward there (``meta_forward_s``, timed)."""
    if any(p.device.type != "cpu" for p in model.parameters()):  # (meta: no data; the virtual mesh is the CPU's)
        return False
    step = profile.step
    return step.get("forward_small_s", 0.0) + step.get("backward_small_s", 0.0) < 3 * meta_forward_s


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (ties kept);
    nothing is copied but the module objects."""
    memo = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in memo:
            twin = torch.empty(t.shape, dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    return copy.deepcopy(module, memo)


def _meta(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and not x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
    return x


class _Recorder:
    """The collective recorder around a block of code (events of this thread, in order)."""

    def __enter__(self):
        self.first = _C.trace_event_count()
        _C.trace_collectives(True)
        return self

    def count(self) -> int:
        return _C.trace_event_count() - self.first

    def __exit__(self, *exc):
        _C.trace_collectives(False)
        raw = _C.trace_events(self.first)
        # The reduction of Partial gradients (tp_grads) is priced from the gradients' bytes
        # (partial_grad_bytes), not from where this run's buckets happened to fall, and
        # differs under DDP: left out here. _before maps a count() to a place in `events`.
        kept = [e["source"] != "tp" for e in raw]
        self._before = list(itertools.accumulate(kept, initial=0))
        self.events = [(e["kind"], e["group_size"], e["bytes"]) for e, keep in zip(raw, kept) if keep]
        if not _C.trace_recording():
            _C.trace_clear()

    def position(self, count: int) -> int:
        """Where the events recorded before ``count()`` returned ``count`` end in ``events``."""
        return self._before[count]


def placement_cost(events, comm: CommModel) -> float:
    return sum(comm.time(kind, g, nbytes) for kind, g, nbytes in events)


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
        with _Recorder() as rec:
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
        real = _cheaper_on_real_tensors(profile, model, time.perf_counter() - captured)
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


# ---- collectives and memory per unit -------------------------------------------------------------

def _unit_hooks(model: nn.Module, profile: Profile, rec: _Recorder, marks: dict):
    """Event counts at each unit's forward start / end and when its output gets a gradient."""
    handles = []
    for u in profile.units:
        mod = model.get_submodule(u.name)

        def pre(m, a, u=u):
            marks["fwd"].append((u.name, "pre", rec.count()))

        def post(m, a, out, u=u):
            marks["fwd"].append((u.name, "post", rec.count()))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point() and torch.is_grad_enabled():
                    t.register_hook(lambda g, n=u.name: marks["grad"].setdefault(n, rec.count()) and None)
                    break
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def _split_events(events: list, marks: dict, forward_end: int, units: list[str]) -> dict:
    """Events per unit and phase: forward events between a unit's start and end (glue
    before a unit goes to it, after the last to the last); backward events from when its
    output gets a gradient to when the next unit's does."""
    per = {u: {"forward": [], "backward": []} for u in units}
    last_end, depth, owner = 0, 0, None
    pending = 0
    for name, kind, count in marks["fwd"]:
        if kind == "pre":
            if depth == 0:
                pending = last_end
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                per[name]["forward"] += events[pending:count]
                last_end, owner = count, name
    if owner is not None:
        per[owner]["forward"] += events[last_end:forward_end]
    grads = sorted(marks["grad"].items(), key=lambda kv: kv[1])
    for i, (name, count) in enumerate(grads):
        end = grads[i + 1][1] if i + 1 < len(grads) else len(events)
        start = forward_end if i == 0 else count
        per[name]["backward"] += events[start:end]
    return per


@dataclass
class UnitCollectives:
    per_unit: dict       # unit -> {"forward": events, "backward": events}, events (kind, group size, bytes)
    param_bytes: dict    # unit -> bytes of its parameters one TP rank holds
    partial_bytes: dict  # unit -> of those, the bytes whose gradients arrive Partial (reduced by tp_grads)
    events: list         # all of them, in order


@replays_profile
def unit_collectives(profile: Profile, model: nn.Module, batch, plan: dict, tp: int, sequence_parallel: bool, *,
                     real: bool = False):
    """Runs the whole model with ``plan`` over a virtual TP mesh (on meta, or on real local
    tensors: ``real``): per unit, the collectives of its forward and backward [(kind, group
    size, bytes)], and the bytes of its parameters one TP rank holds, and of those whose
    gradients are Partial sums."""
    meta = what_if_copy(model, real)  # parallelize_module changes it
    mesh = VirtualMesh([tp], ["TP"])
    with what_if_run(real):
        parallelize_module(meta, mesh, plan)
        marks = {"fwd": [], "grad": {}}
        with _Recorder() as rec:
            handles = _unit_hooks(meta, profile, rec, marks)
            try:
                loss = loss_of(call_model(meta, what_if_batch(batch, real)))
                forward_end = rec.count()
                loss.backward()
            finally:
                for h in handles:
                    h.remove()
    marks = {"fwd": [(n, k, rec.position(c)) for n, k, c in marks["fwd"]],
             "grad": {n: rec.position(c) for n, c in marks["grad"].items()}}
    per = _split_events(rec.events, marks, rec.position(forward_end), [u.name for u in profile.units])
    partial = {id(p) for r in partial_gradients_of(meta) for p in r.last_reduced}
    param_bytes, partial_bytes = {}, {}
    seen = set()
    for u in profile.units:
        param_bytes[u.name] = partial_bytes[u.name] = 0
        for p in meta.get_submodule(u.name).parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = _C.local_tensor(p) if isinstance(p, DTensor) else p
            param_bytes[u.name] += local.numel() * local.element_size()
            if id(p) in partial:
                partial_bytes[u.name] += local.numel() * local.element_size()
    return UnitCollectives(per, param_bytes, partial_bytes, rec.events)


# ---- local compute at sharded shapes -------------------------------------------------------------

def sharded_times(profile: Profile, model: nn.Module, batch, plan: dict, tp: int, *, steps: int = 3,
                  batch_sizes=None) -> dict:
    """Forward and backward seconds per unit of one TP rank (coordinate 0) running the model
    sharded by ``plan`` on real local tensors over a virtual mesh: the compute at sharded
    shapes and the dispatcher's work, without the collectives' time, and the bytes each
    unit saves for backward on that rank. Returns {batch size: (forward per unit, backward
    per unit, saved bytes per unit, the forward + backward's peak beyond the gradients)}."""

    real = copy.deepcopy(model)
    mesh = VirtualMesh([tp], ["TP"])
    batch_sizes = batch_sizes or profile.measured_at
    out = {}
    with what_if_run(real=True):
        parallelize_module(real, mesh, plan)
        layout = find_layout(real, profile.blocks)
        for n in batch_sizes:
            # processor time at the profile's contention: the ranks time different
            # layouts at once, and one that finishes first leaves the cores to the others
            working: dict = {}
            f, b, _, _, _ = median_times(real, layout, slice_batch(batch, n), None, steps,
                                          wall_per_cpu=profile.wall_per_cpu, working=working)
            out[n] = (f, b, saved_per_unit(real, layout, slice_batch(batch, n)), working.get(n))
    return out


@replays_profile
def sharded_saved(profile: Profile, model: nn.Module, batch, plan: dict, tp: int, batch_sizes=None) -> dict:
    """The bytes each unit saves for backward on one TP rank under ``plan``, from a what-if
    run on meta (no data, no compute): {batch size: saved bytes per unit}."""

    meta = meta_copy(model)
    mesh = VirtualMesh([tp], ["TP"])
    out = {}
    with what_if():
        parallelize_module(meta, mesh, plan)
        layout = find_layout(meta, profile.blocks)
        for n in batch_sizes or profile.measured_at:
            out[n] = saved_per_unit(meta, layout, tree_map(_meta, slice_batch(batch, n)))
    return out
