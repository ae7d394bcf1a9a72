"""DeviceMesh: a named, n-dimensional arrangement of ranks.

The process groups come from ``torch.distributed.device_mesh.DeviceMesh``; this class
adds the names veScale users know (``get_strategy_size``, rank <-> coordinate lookup,
sub-mesh enumeration) and hands the C++ engine its view of the mesh.

Every process group vescale creates has the vescale collective timeout (5 minutes
unless set; torch's own default is 30): when a rank dies or stops taking part, the
others raise after that long instead of hanging. Sub-groups need it explicitly:
torch's ``new_group`` falls back to torch's default, not the world group's timeout.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import math
import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as _TorchDeviceMesh

from . import _C
from .debug import install_failure_notes

__all__ = ["DeviceMesh", "init_device_mesh", "get_device_mesh", "set_device_mesh", "collective_timeout",
           "process_group"]


class DeviceMesh:
    """An n-d mesh of ranks with optional dimension names.

    ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("DP", "TP"))`` must be
    created on every rank (it creates one process group per mesh dim and row, with
    ``timeout``, default ``collective_timeout()``; a dim over the whole world uses the
    world group as it is).
    """

    def __init__(self, device_type: str, mesh, *, mesh_dim_names: Sequence[str] | None = None,
                 timeout: timedelta | float | None = None, _torch_mesh: _TorchDeviceMesh | None = None,
                 _flat_groups: dict[frozenset, str] | None = None):
        ranks = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
        _check_ranks(ranks)
        if mesh_dim_names is not None:
            mesh_dim_names = tuple(mesh_dim_names)
            if len(mesh_dim_names) != ranks.dim():
                raise ValueError(f"mesh_dim_names {mesh_dim_names} name {len(mesh_dim_names)} dims "
                                 f"but the mesh has {ranks.dim()}")
            if len(set(mesh_dim_names)) != len(mesh_dim_names):
                raise ValueError(f"mesh_dim_names must be distinct, got {mesh_dim_names}")
        if _torch_mesh is None:  # every rank of the world is here: groups can be created
            _torch_mesh = _TorchDeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names,
                                           backend_override=_timeout_overrides(device_type, ranks.shape, timeout))
            _flat_groups = _create_flat_groups(ranks, timeout)
        self._torch = _torch_mesh
        # this rank's group over the ranks of several mesh dims at once, per set of dims
        self._flat_groups = _flat_groups if _flat_groups is not None else {}
        install_failure_notes()  # after torch's own hook (init_process_group), so that ours runs first
        self._device_type = device_type
        self._ranks = ranks
        self._names = mesh_dim_names
        coordinate = _torch_mesh.get_coordinate()
        self._c = None
        if coordinate is not None:
            self._c = _C.Mesh(list(ranks.shape), ranks.flatten().tolist(),
                              list(mesh_dim_names or [""] * ranks.dim()),
                              [_torch_mesh.get_group(i).group_name for i in range(ranks.dim())],
                              list(coordinate), device_type,
                              self._flat_groups.get(frozenset(range(ranks.dim())), ""))

    # ---- shape and names ----
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The ranks, laid out in the mesh's shape."""
        return self._ranks

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._ranks.shape)

    @property
    def ndim(self) -> int:
        return self._ranks.dim()

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    def size(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            return self._ranks.numel()
        return self.shape[self._dim(mesh_dim)]

    def get_strategy_size(self, dim_name: str) -> int:
        """Size of the mesh dim called ``dim_name`` (e.g. ``"TP"``)."""
        return self.size(dim_name)

    # ---- ranks and coordinates ----
    def get_rank(self) -> int:
        return dist.get_rank()

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate, or None when it is not part of the mesh."""
        coord = self._torch.get_coordinate()
        return None if coord is None else tuple(coord)

    def get_local_rank(self, mesh_dim: int | str = 0) -> int:
        """This rank's index along one mesh dim."""
        coord = self.get_coordinate()
        if coord is None:
            raise RuntimeError(f"rank {dist.get_rank()} is not part of {self}")
        return coord[self._dim(mesh_dim)]

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        """The coordinate at which global ``rank`` sits."""
        where = (self._ranks == rank).nonzero()
        if where.numel() == 0:
            raise ValueError(f"rank {rank} is not part of {self}")
        return tuple(int(i) for i in where[0])

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """The global rank at ``coordinate``."""
        if len(coordinate) != self.ndim:
            raise ValueError(f"coordinate {tuple(coordinate)} has {len(coordinate)} entries; the mesh has {self.ndim} dims")
        return int(self._ranks[tuple(coordinate)])

    def submeshes(self, mesh_dim: int | str) -> list[list[int]]:
        """The rank groups along ``mesh_dim``: every 1-d slice of the mesh in that direction."""
        d = self._dim(mesh_dim)
        moved = self._ranks.movedim(d, -1).reshape(-1, self.shape[d])
        return [row.tolist() for row in moved]

    def get_group(self, mesh_dim: int | str = 0) -> dist.ProcessGroup:
        """This rank's process group along ``mesh_dim``."""
        return self._torch.get_group(self._dim(mesh_dim))

    def __getitem__(self, names: str | Sequence[str]) -> "DeviceMesh":
        """The sub-mesh over the named dims, e.g. ``mesh["TP"]``."""
        key = (names,) if isinstance(names, str) else tuple(names)
        for n in key:
            self._dim(n)
        sub = self._torch[key if len(key) > 1 else key[0]]
        position = {self._dim(n): i for i, n in enumerate(key)}
        flat = {frozenset(position[d] for d in dims): name for dims, name in self._flat_groups.items()
                if dims <= position.keys()}
        return DeviceMesh(self._device_type, sub.mesh, mesh_dim_names=key, _torch_mesh=sub, _flat_groups=flat)

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self._names or mesh_dim not in self._names:
                raise KeyError(f"{self} has no dimension named {mesh_dim!r}; its dimensions are {self._names}")
            return self._names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-d mesh")
        return mesh_dim % self.ndim

    def _require_member(self) -> "_C.Mesh":
        if self._c is None:
            raise RuntimeError(f"rank {dist.get_rank()} is not part of {self} and cannot hold its DTensors")
        return self._c

    def to_torch(self) -> _TorchDeviceMesh:
        """The equivalent torch.distributed DeviceMesh (same process groups)."""
        return self._torch

    def __eq__(self, other) -> bool:
        if other is self:  # the common case (a module's hooks pass their own mesh), without a tensor compare
            return True
        return (isinstance(other, DeviceMesh) and self._device_type == other._device_type
                and torch.equal(self._ranks, other._ranks) and self._names == other._names
                and self._c == other._c)

    def __hash__(self) -> int:
        return hash((self._device_type, tuple(self._ranks.flatten().tolist()), self.shape, self._names))

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names}" if self._names else ""
        return f"DeviceMesh('{self._device_type}', {self._ranks.tolist()}{names})"


def _create_flat_groups(ranks: torch.Tensor, timeout) -> dict[frozenset, str]:
    """This rank's group over each set of two or more mesh dims with more than one rank
    (every slice of the mesh along them), created with the mesh (creating a group takes
    every rank of the world, which a sub-mesh or a redistribution does not have at hand).
    The engine reduces a value Partial over all of a mesh's dims with one all-reduce
    through it instead of one per dim (the sub-mesh ``mesh["DP", "TP"]`` of a 3-d mesh
    gets its dims' group). Slices that span the world use the world group; none for the
    planner's virtual meshes over fake groups. Ranks outside the mesh take part in
    creating the groups too (every rank must) and keep none. The mesh dims' own groups use
    the world's backend (`_timeout_overrides` names none), so the flat ones can too."""
    if ranks.dim() < 2 or dist.get_backend() == "fake":
        return {}
    timeout = _as_timedelta(timeout) if timeout is not None else collective_timeout()
    real = [d for d in range(ranks.dim()) if ranks.shape[d] > 1]
    groups: dict[frozenset, str] = {}
    for k in range(2, len(real) + 1):
        for dims in itertools.combinations(real, k):
            rest = [d for d in range(ranks.dim()) if d not in dims]
            slices = ranks.permute(*rest, *dims).reshape(-1, math.prod(ranks.shape[d] for d in dims))
            if slices.shape[1] == dist.get_world_size():
                name = dist.group.WORLD.group_name
            else:
                mine, _ = dist.new_subgroups_by_enumeration(slices.tolist(), timeout=timeout)
                name = mine.group_name if mine is not None else ""
            # the size-1 dims do not change the slices: the sets with them share the group
            for extra in range(ranks.dim() - len(real) + 1):
                for ones in itertools.combinations([d for d in range(ranks.dim()) if d not in real], extra):
                    groups[frozenset(dims + ones)] = name
    return groups


def _check_ranks(ranks: torch.Tensor) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vescale needs torch.distributed: launch with torchrun (vescale.init_device_mesh then "
                           "initialises it) or call torch.distributed.init_process_group before creating a DeviceMesh")
    world = dist.get_world_size()
    flat = ranks.flatten().tolist()
    if ranks.numel() > world:
        raise ValueError(f"a mesh of shape {tuple(ranks.shape)} needs {ranks.numel()} ranks but the world "
                         f"has {world}; launch more processes (torchrun --nproc-per-node) or use a smaller mesh")
    if len(set(flat)) != len(flat):
        raise ValueError(f"mesh ranks must be distinct, got {ranks.tolist()}")
    bad = [r for r in flat if not 0 <= r < world]
    if bad:
        raise ValueError(f"mesh ranks {bad} are outside the world of {world} ranks")


# ---- timeouts --------------------------------------------------------------------------------

_DEFAULT_TIMEOUT_S = 300.0
_timeout: timedelta | None = None  # set by init_device_mesh(timeout=...)


def collective_timeout() -> timedelta:
    """How long a collective on a process group vescale creates waits for the other ranks
    before it raises: the last ``init_device_mesh(timeout=...)``, else the environment
    variable ``VESCALE_COLLECTIVE_TIMEOUT`` (seconds), else 5 minutes."""
    if _timeout is not None:
        return _timeout
    env = os.environ.get("VESCALE_COLLECTIVE_TIMEOUT")
    return _as_timedelta(float(env)) if env else timedelta(seconds=_DEFAULT_TIMEOUT_S)


def _as_timedelta(timeout: timedelta | float) -> timedelta:
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"a collective timeout must be positive, got {timeout}")
    return timeout


def _timeout_overrides(device_type: str, shape, timeout) -> tuple:
    """torch DeviceMesh's per-dim (backend, options) carrying the timeout. A dim that spans
    the whole world keeps (None, None): torch then reuses the world group instead of
    opening another one (its timeout is the one it was created with: vescale's when
    init_device_mesh created it)."""
    if dist.get_backend() in ("fake", "vescale_sim"):  # torch's fake group (what-if planning) and
        # vescale.debug.simulate's take no backend options
        return tuple((None, None) for _ in shape)
    options = _pg_options(device_type, _as_timedelta(timeout) if timeout is not None else collective_timeout())
    return tuple((None, None) if size == dist.get_world_size() else (None, options) for size in shape)


def _pg_options(device_type: str, timeout: timedelta):
    if device_type == "cuda" and dist.is_nccl_available():
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
    else:  # gloo takes only the timeout from its options
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def _init_world_from_env(device_type: str) -> None:
    """The world group, as torch's init_device_mesh makes it under torchrun, with the vescale timeout."""
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if dist.is_initialized() or not launched:
        return  # without torchrun's variables, DeviceMesh says how to set up torch.distributed
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=collective_timeout())


_global_mesh: DeviceMesh | None = None
# Meshes init_device_mesh made, by (device, shape, names, timeout), and process groups
# process_group made, by (ranks, timeout): each with the world group it was made in (a new
# world, after destroy_process_group, makes them anew).
_meshes: dict[tuple, tuple[object, DeviceMesh]] = {}
_groups: dict[tuple, tuple[object, dist.ProcessGroup]] = {}


def of_this_world(kept: tuple | None, make) -> tuple:
    """``kept``, a ``(world group, value)`` pair, if it was made in the current world;
    else a new pair with ``make()``. What holds a process group must not outlive its world:
    after destroy_process_group and a new init_process_group, the old groups are gone."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return kept if kept is not None and kept[0] is world else (world, make())


def _once_per_world(made: dict, key: tuple, make):
    made[key] = of_this_world(made.get(key), make)
    return made[key][1]


# ---- exit ------------------------------------------------------------------------------------
# What vescale keeps for reuse (the meshes and groups above, the Python mesh of each C++
# mesh, the checkpoint's group) would keep torch's process groups alive after
# destroy_process_group, until the interpreter tears itself down. A gloo group's worker
# thread lets go of its last collective's work a moment after the collective completes;
# when that work holds a tensor whose Python object is already gone (the `status` of a
# closing `dist.broadcast(status)`), letting go takes the GIL, and a thread that takes the
# GIL during teardown exits on the spot, inside a destructor: "terminate called without an
# active exception", SIGABRT, after the program has finished. So at exit, while Python
# still runs, vescale lets go of what it kept: groups nothing else holds are destroyed
# there, their worker threads joined. (A mesh or DTensor the program itself still holds
# keeps its groups, as torch's own DeviceMesh does.)
_exit_releases: list = []


def release_at_exit(release) -> None:
    """Has ``release()`` (which drops references vescale keeps to meshes or process groups)
    run at interpreter exit, before teardown."""
    _exit_releases.append(release)


def _release_kept_groups() -> None:
    global _global_mesh
    _global_mesh = None
    _meshes.clear()
    _groups.clear()
    for release in _exit_releases:
        release()
    gc.collect()  # meshes held only in reference cycles (a model's hooks) go now too


# Registered before the checkpoint module's join of a background save (atexit runs the
# latest first), so a save still writing keeps its group until it is done.
atexit.register(_release_kept_groups)


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None,
                     timeout: timedelta | float | None = None) -> DeviceMesh:
    """Creates a mesh of ranks 0..N-1 in row-major order and makes it the global mesh.

    Must be called on every rank. ``vescale.get_device_mesh()`` returns it afterwards.
    Under torchrun, the default process group is initialised here if it is not yet
    (gloo for ``"cpu"``, NCCL for ``"cuda"``). ``timeout`` (a timedelta or seconds)
    becomes the collective timeout of every process group vescale creates from now on
    (see ``collective_timeout``): a rank that dies or stops taking part makes the others
    raise after that long instead of hanging.

    The same shape, names and timeout in the same world give the same mesh: its process
    groups are made once. They are threads and sockets (gloo) or communicators (NCCL) that
    torch never frees, so a program that parallelizes again and again (a sweep, the
    planner's measured trials, ``vescale.parallelize`` per model) would otherwise gather
    new ones every time (2,200 threads a rank after 360 set-ups of the set-up fuzzer).
    """
    global _timeout
    if timeout is not None:
        _timeout = _as_timedelta(timeout)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if any(s <= 0 for s in mesh_shape):
        raise ValueError(f"mesh_shape must be positive, got {mesh_shape}")
    _init_world_from_env(device_type)
    n = math.prod(mesh_shape)
    if dist.is_initialized() and n > dist.get_world_size():
        raise ValueError(f"a mesh of shape {mesh_shape} needs {n} ranks but the world has "
                         f"{dist.get_world_size()}; launch more processes (torchrun --nproc-per-node) "
                         f"or use a smaller mesh")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    mesh = _once_per_world(_meshes, (device_type, mesh_shape, names, collective_timeout()),
                           lambda: DeviceMesh(device_type, torch.arange(n).reshape(mesh_shape), mesh_dim_names=names))
    set_device_mesh(mesh)
    return mesh


def process_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The process group over ``ranks`` (global ranks), with the vescale collective
    timeout, made once per world (``init_device_mesh`` says why: torch never frees one).
    As with torch's ``new_group``, every rank of the world calls it for every group, in
    the same order, whether or not it is a member."""
    members, timeout = [int(r) for r in ranks], collective_timeout()
    return _once_per_world(_groups, (tuple(members), timeout), lambda: dist.new_group(members, timeout=timeout))


def get_device_mesh() -> DeviceMesh:
    """The global mesh made by the last ``init_device_mesh``."""
    if _global_mesh is None:
        raise RuntimeError("no global device mesh yet: call vescale.init_device_mesh(device_type, mesh_shape, "
                           "mesh_dim_names=...) first")
    return _global_mesh


def set_device_mesh(mesh: DeviceMesh | None) -> None:
    global _global_mesh
    _global_mesh = mesh
