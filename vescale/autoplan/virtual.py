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

What-ifs run on real local tensors instead where that is cheaper
(``cheaper_on_real_tensors``): meta tensors take torch's Python meta kernels, op by op,
whatever the shapes, so for a small model a real step at the sharded shapes (the fake
collectives leave their outputs unwritten; nothing reads them) costs less than the same
step on meta. Both give the same collectives (tests/python/test_autoplan.py).

Used by the tensor-parallel search (``tp_search``), the collectives and memory per unit
(``whatif``) and the split backward's kept bytes (``split_backward``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools

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
from ..placement_types import Replicate
from .commfit import CommModel
from .profile import Profile
from .scalars import replay_mode

__all__ = ["VirtualMesh", "what_if", "what_if_run", "what_if_copy", "what_if_batch", "meta_copy", "as_meta",
           "cheaper_on_real_tensors", "Recorder", "placement_cost"]

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
    return batch if real else tree_map(as_meta, batch)


def cheaper_on_real_tensors(profile: Profile, model: nn.Module, meta_forward_s: float) -> bool:
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


def as_meta(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and not x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
    return x


class Recorder:
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

