"""DTensor: a torch.Tensor whose data is spread over a DeviceMesh.

A DTensor is an ordinary ``torch.Tensor`` object backed by vescale's C++
``DTensorImpl``: every aten op on it is intercepted below autograd by vescale's
dispatch key, so there is no Python on the per-op path. Because op results are made
in C++, their Python class is ``torch.Tensor`` (or ``nn.Parameter``);
``isinstance(x, vescale.DTensor)`` checks the implementation instead of the class,
and the DTensor methods below are reachable on any such tensor (see ``_tensor_methods``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from . import _C
from .device_mesh import DeviceMesh, get_device_mesh, release_at_exit
from .placement_types import Placement, Replicate, from_c, to_c

__all__ = ["DTensor", "distribute_tensor"]

_meshes: dict = {}  # _C.Mesh -> DeviceMesh, to hand back the Python mesh of a DTensor
release_at_exit(_meshes.clear)


def _register(mesh: DeviceMesh) -> "_C.Mesh":
    c = mesh._require_member()
    _meshes.setdefault(c, mesh)
    return c


def _resolve(mesh: DeviceMesh | None, placements: Sequence[Placement] | None, ndim: int):
    mesh = mesh if mesh is not None else get_device_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a vescale.DeviceMesh, got {type(mesh).__name__}")
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"got {len(placements)} placements {tuple(placements)} for a {mesh.ndim}-d mesh "
                         f"{mesh}; give one placement per mesh dimension")
    return mesh, _C.normalize_placements(to_c(placements), ndim)


class _DTensorMeta(type(torch.Tensor)):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Tensor) and _C.is_dtensor(obj)


class DTensor(torch.Tensor, metaclass=_DTensorMeta):
    """A distributed tensor. Make one with ``DTensor.from_local`` or ``vescale.distribute_tensor``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, *args, **kwargs):
        raise TypeError("DTensors are made with DTensor.from_local(...) or vescale.distribute_tensor(...)")

    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool = False,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None) -> torch.Tensor:
        """Wraps each rank's ``local_tensor`` as its shard of one DTensor.

        Without ``shape``, shards are assumed even (global size = local size x shards),
        unless ``run_check`` is set: then the local sizes are gathered to get the exact
        global shape (uneven shards allowed), and Replicate dims are broadcast from the
        first rank of the mesh dim, as torch's DTensor does. Without ``stride`` the global
        strides follow the shard's layout; where shards are uneven so that a dim has one
        element or none on some ranks and more on others, the ranks cannot all read it and
        take the mesh's first rank's (a small broadcast: every rank of the mesh calls this).
        """
        if not isinstance(local_tensor, torch.Tensor):
            raise TypeError(f"from_local expects a torch.Tensor, got {type(local_tensor).__name__}")
        if isinstance(local_tensor, DTensor):
            raise TypeError("from_local expects this rank's plain local tensor, got a DTensor")
        mesh, cp = _resolve(device_mesh, placements, local_tensor.dim())
        if run_check:
            local_tensor = _broadcast_replicated(local_tensor, mesh, cp)
        may_be_uneven = shape is not None or run_check  # without either, shards are even by contract
        if shape is None:
            shape = _global_shape(local_tensor, mesh, cp, exact=run_check)
        shape = [int(s) for s in shape]
        c_mesh = _register(mesh)
        if stride is None:
            stride = _global_strides_of(shape, local_tensor)
            # a dim of one element on some ranks may have any stride there: the ranks'
            # readings can differ (dispatch/api.h)
            if may_be_uneven and _C.shard_steps_may_differ(shape, cp, list(mesh.shape)):
                stride = _C.strides_of_mesh_rank(stride, c_mesh, 0)
        return _C.from_local(local_tensor, c_mesh, cp, shape, list(stride))

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard (shares storage). Differentiable; where the tensor is Partial, the
        shard's gradient is taken as the whole (replicated) gradient unless
        ``grad_placements`` says otherwise. The shard is not an autograd view of the DTensor:
        an in-place op on one changes the other's values, not its gradient path."""
        return _C.to_local(self, None if grad_placements is None else to_c(grad_placements))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor. Differentiable."""
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None, *, async_op: bool = False) -> torch.Tensor:
        """The same global tensor with other placements. Differentiable.

        With ``async_op=True`` the collective is issued and the result returned at once,
        as torch's functional collectives do: the first use of its shard (any op on it,
        ``to_local()``, another redistribution) waits for the collective, so work that
        does not need the result can run meanwhile. The values are the same either way."""
        mesh = self.device_mesh
        if device_mesh is not None and device_mesh != mesh:
            raise ValueError(f"redistribute moves a DTensor within its mesh {mesh}; moving it to another mesh "
                             f"{device_mesh} is not supported (use to_local / from_local)")
        if placements is None:
            raise ValueError("redistribute needs the target placements, e.g. [Replicate()]")
        _, cp = _resolve(mesh, placements, self.dim())
        return _C.redistribute(self, cp, async_op=async_op)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return from_c(_C.placements_of(self))

    @property
    def device_mesh(self) -> DeviceMesh:
        return _meshes[_C.mesh_of(self)]

    @property
    def _local_tensor(self) -> torch.Tensor:
        return _C.local_tensor(self)


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> torch.Tensor:
    """Splits a full tensor that every rank holds into a DTensor.

    With ``src_data_rank`` (default 0) the values are first broadcast from the mesh's
    ``src_data_rank``-th rank (row-major over the mesh), so the result is consistent
    even if ranks disagree; ``None`` trusts every rank's copy. The result is a leaf
    and requires grad when ``tensor`` does. A tensor on another device than the mesh's
    is moved there first (as torch's distribute_tensor does).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor expects a plain tensor, got a DTensor; use .redistribute() instead")
    if tensor.is_meta:
        from .deferred import is_deferred

        if not is_deferred(tensor):
            raise ValueError("distribute_tensor got a meta tensor, which has no values to give: build the model "
                             "with vescale.deferred_init(ModelClass, ...) to shard it without allocating it whole")
        return _materialize_shard(tensor, *_resolve(device_mesh, placements, tensor.dim()))
    mesh, cp = _resolve(device_mesh, placements, tensor.dim())
    return _C.distribute_tensor(_on_device_of(tensor, mesh), _register(mesh), cp, src_data_rank)


def _materialize_shard(tensor: torch.Tensor, mesh: DeviceMesh, cp) -> torch.Tensor:
    """A tensor from vescale.deferred_init: this rank computes only its own shard."""
    from .boxes import Box
    from .deferred import materialize

    if any(kind[0] == "P" for kind in cp):
        raise ValueError("a deferred tensor can be materialised as Shard or Replicate, not Partial")
    parts = _shard_parts(list(tensor.shape), mesh, cp)
    if len(parts) == 1:
        local = materialize(tensor, parts[0][1])
    else:  # an InterleavedShard: one piece per block, each written in place (temporaries
        # of a piece's size, freed between the shards being kept, would fragment the heap)
        sizes, _ = _C.local_shape(list(tensor.shape), cp, list(mesh.shape), list(mesh.get_coordinate()))
        local = torch.empty(sizes, dtype=tensor.dtype, device="cpu")
        for shard_box, global_box in parts:
            materialize(tensor, global_box, into=shard_box.view_of(local, Box((0,) * local.dim(), tuple(sizes))))
    out = _C.from_local(_on_device_of(local, mesh), _register(mesh), cp, list(tensor.shape),
                        _strides_like(tensor.shape, tensor.stride()))
    return out.requires_grad_(tensor.requires_grad)


def _on_device_of(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``tensor`` on the mesh's device type, as torch's distribute_tensor moves it: a model
    built on the CPU (or materialised there by deferred_init) is sharded onto a CUDA mesh's
    current device."""
    return tensor if tensor.device.type == mesh.device_type else tensor.to(mesh.device_type)


# ---- helpers -------------------------------------------------------------------------

def shard_parts(t: DTensor) -> list:
    """This rank's shard of ``t`` as (box of the shard, box of the global tensor) pairs:
    one, or one per combination of blocks of the InterleavedShard dims (the shard lays
    each dim's pieces side by side)."""
    return _shard_parts(list(t.shape), t.device_mesh, to_c(t.placements))


def _shard_parts(shape: list[int], mesh: DeviceMesh, cp, coordinate: Sequence[int] | None = None) -> list:
    """As shard_parts, for the rank at ``coordinate`` of ``mesh`` (default: this rank)."""
    import itertools

    from .boxes import Box

    if coordinate is None:
        coordinate = mesh.get_coordinate()
    sizes, offsets = _C.local_shape(shape, cp, list(mesh.shape), list(coordinate))
    # Per interleaved dim: (dim, groups, this rank's piece index); no dim is split twice.
    interleaved = [(kind[1], kind[2], coordinate[m]) for m, kind in enumerate(cp) if kind[0] == "I"]
    piece_sizes = list(sizes)
    for d, g, _ in interleaved:
        piece_sizes[d] //= g
    parts = []
    for blocks in itertools.product(*(range(g) for _, g, _ in interleaved)):
        local, glob = [0] * len(shape), list(offsets)
        for (d, g, rank), j in zip(interleaved, blocks):
            local[d] = j * piece_sizes[d]
            glob[d] = j * (shape[d] // g) + rank * piece_sizes[d]
        parts.append((Box(tuple(local), tuple(piece_sizes)), Box(tuple(glob), tuple(piece_sizes))))
    return parts


def _strides_like(shape: Sequence[int], like: Sequence[int]) -> list[int]:
    order = sorted(range(len(shape)), key=lambda d: (like[d], -d))  # innermost first
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step *= max(shape[d], 1)
    return strides


def _global_strides_of(shape: Sequence[int], local: torch.Tensor) -> list[int]:
    """The global strides a shard implies, as torch's from_local reads them: the shard's dim
    order, densely packed, and stride 0 where the shard is expanded (a broadcast shard
    stays a broadcast, sharing its memory, rather than becoming a dense copy). Where the
    ranks' shards may imply different strides, from_local takes the first rank's."""
    expanded = [d for d in range(local.dim()) if local.size(d) > 1 and local.stride(d) == 0]
    packed = _strides_like([1 if d in expanded else n for d, n in enumerate(shape)], local.stride())
    return [0 if d in expanded else s for d, s in enumerate(packed)]



def _global_shape(local: torch.Tensor, mesh: DeviceMesh, cp, exact: bool) -> list[int]:
    shape = list(local.shape)
    # Innermost mesh dim first: its shards add up to the extent the next one splits.
    for m in reversed(range(mesh.ndim)):
        kind = cp[m]
        if kind[0] == "I":  # even pieces by definition
            shape[kind[1]] *= mesh.size(m)
            continue
        if kind[0] != "S":
            continue
        d = kind[1]
        if exact:
            sizes = [None] * mesh.size(m)
            dist.all_gather_object(sizes, shape[d], group=mesh.get_group(m))
            shape[d] = sum(sizes)
        else:
            shape[d] *= mesh.size(m)
    return shape


def _broadcast_replicated(local: torch.Tensor, mesh: DeviceMesh, cp) -> torch.Tensor:
    """Replicated mesh dims take the first rank's values; gradients still reach ``local``."""
    dims = [m for m in range(mesh.ndim) if cp[m][0] == "R" and mesh.size(m) > 1]
    if not dims:
        return local
    with torch.no_grad():
        values = local.detach().clone()
        for m in dims:
            group = mesh.get_group(m)
            dist.broadcast(values, src=dist.get_global_rank(group, 0), group=group)
    return local + (values - local).detach() if local.requires_grad else values
