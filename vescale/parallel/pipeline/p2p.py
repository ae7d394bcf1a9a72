"""Point-to-point transfer of what crosses a stage boundary, over the pipeline's group.

DTensors cross as their local shards and are rebuilt with the same placements on the
receiver's mesh (Partial values are reduced first). The receiver learns dtype, shapes and
placements from a small header, sent the first time a key occurs on a boundary; later
the receiver knows it and only the payload moves. The key is what both ends know of the
tensors crossing the cut (``_key``): the sender has the tensors, the receiver the
stand-ins its own forward computed for them before its first block (stage.py: glue on
the micro-batch's real inputs, earlier stages' units shadowed on meta). So a crossing
shape that depends on the data (a batch trimmed to its longest sequence) is seen by
both ends alike, with no message beyond the payload; each new shape costs one header.
(Keyed by the micro-batch's input shapes instead, a receiver kept receiving into
buffers of a shape seen before.) Gradients travel back with the shapes of the
forward's local tensors, which the receiver of the gradient sent itself: no header.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from ... import _trace
from ...dtensor import DTensor
from ...placement_types import InterleavedShard, Partial, Replicate, Shard

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_HEADER = 512          # int64 words; the first holds the length used
_SLOTS = 64            # tensors per boundary (one tag each) plus the header
_CACHE = 256           # header keys remembered per boundary (both ends evict alike)
_FORWARD, _BACKWARD = 0, 1


class Boundary:
    """Sends and receives for one pipeline rank."""

    def __init__(self, group, mesh, stages: int):
        self.group, self.mesh, self.stages = group, mesh, stages
        self._sent: dict[int, OrderedDict] = {}
        self._known: dict[int, OrderedDict] = {}
        self._submeshes: dict[tuple, object] = {}
        self.headers_sent = 0
        self.me = dist.get_rank(group)
        self._local: dict = {}  # hand-overs between two stages of this rank (the turn of a V)

    # ---- forward: activations ----

    def send_forward(self, stage: int, mb: int, dst: int, positions: list[int],
                     tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Sends ``tensors`` (stage ``stage``'s outputs) to group rank ``dst``; returns the
        local tensors to run the backward from and the pending sends."""
        if len(tensors) >= _SLOTS:
            raise ValueError(f"{len(tensors)} tensors cross the boundary after stage {stage}; at most {_SLOTS - 1}")
        locals_, described = [], []
        for t in tensors:
            if isinstance(t, DTensor):
                if any(isinstance(p, Partial) for p in t.placements):
                    t = t.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                   for p in t.placements])
                local = t.to_local()
                described.append((local, t))
            else:
                local = t
                described.append((local, None))
            locals_.append(local)
        if dst == self.me:
            self._local[(_FORWARD, stage, mb)] = (positions, described)
            return locals_, []
        works = []
        cache = self._sent.setdefault(stage, OrderedDict())
        key, words = _key(tensors), self._words(positions, described)
        if _remember(cache, key, words):
            header = _header(words)
            self.headers_sent += 1
            works.append((self._isend(header, dst, self._tag(_FORWARD, stage, mb, 0)), header))
        elif cache[key] != words:
            # the receiver would build the tensors from the header it holds for these shapes
            raise RuntimeError(
                f"what crosses the pipeline boundary after stage {stage} changed its dtype, placements or positions "
                f"while keeping its shapes {key[0]} (header {cache[key]} before, {words} now); the next stage "
                f"cannot tell: keep them fixed for a given shape")
        for i, local in enumerate(locals_):
            payload = local.detach().contiguous()
            works.append((self._isend(payload, dst, self._tag(_FORWARD, stage, mb, i + 1)), payload))
        return locals_, works

    def recv_forward(self, stage: int, mb: int, stand_ins: list[torch.Tensor], src: int):
        """What stage ``stage`` sent: (positions, leaves requiring grad, values to put in).
        ``stand_ins``: the receiving stage's own stand-ins for them (their shapes say
        whether a header comes)."""
        if src == self.me:
            return self._take_local(stage, mb)
        cache = self._known.setdefault(stage, OrderedDict())
        key = _key(stand_ins)
        if _remember(cache, key, None):
            header = torch.empty(_HEADER, dtype=torch.int64)
            self._recv(header, src, self._tag(_FORWARD, stage, mb, 0))
            cache[key] = self._decode(header)
        positions, specs = cache[key]
        received = []
        for i, (dtype, local_shape, global_shape, mesh_names, placements) in enumerate(specs):
            buf = torch.empty(local_shape, dtype=dtype)
            self._recv(buf, src, self._tag(_FORWARD, stage, mb, i + 1))
            mesh = None if mesh_names is None else self._submesh(mesh_names)
            received.append(_leaf_and_value(buf, mesh, placements, global_shape))
        return positions, [leaf for leaf, _ in received], [value for _, value in received]

    # ---- backward: gradients ----

    def send_backward(self, stage: int, mb: int, dst: int, leaves: list[torch.Tensor]) -> list:
        """Sends the gradients of stage ``stage``'s received inputs back to group rank ``dst``."""
        if dst == self.me:
            self._local[(_BACKWARD, stage, mb)] = [_grad_of(leaf) for leaf in leaves]
            return []
        works = []
        for i, leaf in enumerate(leaves):
            grad = _grad_of(leaf).contiguous()
            works.append((self._isend(grad, dst, self._tag(_BACKWARD, stage, mb, i + 1)), grad))
        return works

    def recv_backward(self, stage: int, mb: int, src: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients for stage ``stage``'s sent ``outputs`` (local tensors)."""
        if src == self.me:
            return self._local.pop((_BACKWARD, stage + 1, mb))
        grads = []
        for i, out in enumerate(outputs):
            buf = torch.empty(out.shape, dtype=out.dtype)
            self._recv(buf, src, self._tag(_BACKWARD, stage + 1, mb, i + 1))
            grads.append(buf)
        return grads

    # ---- helpers ----

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int):
        """An isend (recorded, while vescale.debug.comm_trace runs, until it is waited for)."""
        token = _trace.collective_started("send", self.group, tensor, peer=dst, source="pipeline")
        return _trace.traced(dist.isend(tensor, group=self.group, group_dst=dst, tag=tag), token)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        token = _trace.collective_started("recv", self.group, tensor, peer=src, source="pipeline")
        dist.irecv(tensor, group=self.group, group_src=src, tag=tag).wait()
        _trace.collective_finished(token)

    def _take_local(self, stage: int, mb: int):
        """A hand-over within this rank: new leaves over the same values (no copy)."""
        positions, described = self._local.pop((_FORWARD, stage, mb))
        received = []
        for local, dt in described:
            mesh, placements, shape = (None, None, None) if dt is None else (dt.device_mesh, dt.placements, dt.shape)
            received.append(_leaf_and_value(local.detach(), mesh, placements, shape))
        return positions, [leaf for leaf, _ in received], [value for _, value in received]

    def _tag(self, direction: int, stage: int, mb: int, slot: int) -> int:
        return (((mb * self.stages + stage) * 2 + direction) * _SLOTS + slot) % (2**31 - 1)

    def _submesh(self, names: tuple):
        if names not in self._submeshes:
            self._submeshes[names] = self.mesh[names]
        return self._submeshes[names]

    def _words(self, positions: list[int], described: list) -> list[int]:
        """The header's words: positions, then per tensor its dtype, local shape and (a
        DTensor) global shape and placements."""
        words = [len(positions), *positions]
        dim_names = list(self.mesh.mesh_dim_names or ())
        for local, dt in described:
            words += [_DTYPES.index(local.dtype), local.dim(), *local.shape]
            if dt is None:
                words.append(-1)
                continue
            names = dt.device_mesh.mesh_dim_names
            if not names or any(n not in dim_names for n in names):
                raise ValueError(f"a DTensor on mesh {dt.device_mesh} crosses a pipeline boundary; its mesh dims must "
                                 f"be named dims of the pipeline's mesh {self.mesh}")
            words += [len(names), *dt.shape]
            for n, p in zip(names, dt.placements):
                words += [dim_names.index(n), _placement_word(p)]
        if len(words) + 1 > _HEADER:
            raise ValueError("the boundary's description does not fit the pipeline header")
        return words

    def _decode(self, header: torch.Tensor) -> tuple[list[int], list]:
        w = header.tolist()[1:header[0]]
        n = w[0]
        positions, w = w[1:1 + n], w[1 + n:]
        dim_names = list(self.mesh.mesh_dim_names or ())
        specs = []
        for _ in range(n):
            dtype, ndim = _DTYPES[w[0]], w[1]
            local_shape, w = tuple(w[2:2 + ndim]), w[2 + ndim:]
            k, w = w[0], w[1:]
            if k == -1:
                specs.append((dtype, local_shape, None, None, None))
                continue
            global_shape, w = tuple(w[:ndim]), w[ndim:]
            names, placements = [], []
            for _ in range(k):
                names.append(dim_names[w[0]])
                placements.append(_placement_of_word(w[1]))
                w = w[2:]
            specs.append((dtype, local_shape, global_shape, tuple(names), placements))
        return positions, specs


def _header(words: list[int]) -> torch.Tensor:
    """The header message: its length used, the words, zeros to ``_HEADER`` words."""
    return torch.tensor([len(words) + 1, *words] + [0] * (_HEADER - len(words) - 1), dtype=torch.int64)


def _key(tensors: list[torch.Tensor]) -> tuple:
    """What both ends of a boundary know of the tensors crossing it: their global shapes,
    and the autocast state, under which the sender's dtype differs from that of the
    receiver's stand-ins (computed on meta, which autocast leaves alone)."""
    devices = sorted({t.device.type for t in tensors})
    autocast = tuple((d, torch.get_autocast_dtype(d)) for d in devices if torch.is_autocast_enabled(d))
    return tuple(tuple(t.shape) for t in tensors), autocast


def _placement_word(p) -> int:
    """A placement (never Partial here) as one header word: Shard(d) is d, Replicate -1,
    InterleavedShard(d, g) -(2 + d + 64 g)."""
    if isinstance(p, Shard):
        return p.dim
    if isinstance(p, InterleavedShard):
        return -(2 + p.dim + 64 * p.groups)
    return -1


def _placement_of_word(w: int):
    if w >= 0:
        return Shard(w)
    if w == -1:
        return Replicate()
    return InterleavedShard((-w - 2) % 64, (-w - 2) // 64)


def _leaf_and_value(local: torch.Tensor, mesh, placements, global_shape):
    """A received local tensor as the leaf whose gradient goes back (floating point
    requires grad) and the value the stage puts in: the leaf, or a DTensor over it."""
    if local.is_floating_point() or local.is_complex():
        local.requires_grad_()
    if mesh is None:
        return local, local
    return local, DTensor.from_local(local, mesh, placements, shape=global_shape)


def _grad_of(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _remember(cache: OrderedDict, key, value) -> bool:
    """True when ``key`` is new (its header must travel; ``value`` is stored for it);
    keeps the newest ``_CACHE`` keys."""
    if key in cache:
        cache.move_to_end(key)
        return False
    cache[key] = value
    if len(cache) > _CACHE:
        cache.popitem(last=False)
    return True
