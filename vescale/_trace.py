"""The Python side's hook into the collective recorder (collectives/trace.h).

The engine records the collectives it issues itself. Collectives that Python issues
through torch.distributed (DDP's bucket all-reduce, ZeRO's gathers, the pipeline's
sends and receives) are recorded here, with the same fields. While nothing records,
each hook costs one call into the extension that reads a flag.

    token = collective_started("all_reduce", group, tensor)   # None while off
    work = dist.all_reduce(tensor, group=group, async_op=True)
    ...
    work.wait(); collective_finished(token)

Public as ``vescale.debug.collective_started`` / ``collective_finished`` /
``record_collective`` for components outside vescale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C

__all__ = ["recording", "collective_started", "collective_finished", "record_collective", "TracedWork", "call",
           "traced"]


def recording() -> bool:
    """Whether the collective recorder is on (vescale.debug.comm_trace)."""
    return _C.trace_recording()


def _group_facts(group) -> tuple[str, int]:
    if group is None:
        group = dist.group.WORLD
    name = getattr(group, "group_name", None) or str(group)
    return name, dist.get_world_size(group)


def _nbytes(tensor_or_bytes) -> int:
    if isinstance(tensor_or_bytes, torch.Tensor):
        return tensor_or_bytes.numel() * tensor_or_bytes.element_size()  # metadata only: meta tensors work
    return int(tensor_or_bytes)


def collective_started(kind: str, group, tensor_or_bytes, *, peer: int = -1, source: str = "python",
                       mesh_dim: int = -1, mesh_dim_name: str = ""):
    """Starts timing one collective; returns a token for collective_finished, or None
    while nothing records. ``group`` is a ProcessGroup (None: the world), ``peer`` the
    other end of a send/recv (its rank within ``group``)."""
    if not _C.trace_recording():
        return None
    name, size = _group_facts(group)
    return (kind, name, size, _nbytes(tensor_or_bytes), _C.trace_now_ns(), _C.trace_scope(), peer, source,
            mesh_dim, mesh_dim_name)


def collective_finished(token) -> None:
    """Records the collective that ``token`` started, ending now."""
    if token is None:
        return
    kind, name, size, nbytes, start, scope, peer, source, mesh_dim, mesh_dim_name = token
    _C.trace_record(kind, name, size, nbytes, start, _C.trace_now_ns(), op="", scope=scope, peer=peer,
                    source=source, mesh_dim=mesh_dim, mesh_dim_name=mesh_dim_name)


def record_collective(kind: str, group, tensor_or_bytes, start_ns: int, end_ns: int, *, peer: int = -1,
                      source: str = "python") -> None:
    """Records a collective that already happened (times from ``_C.trace_now_ns()``)."""
    if not _C.trace_recording():
        return
    name, size = _group_facts(group)
    _C.trace_record(kind, name, size, _nbytes(tensor_or_bytes), start_ns, end_ns, scope=_C.trace_scope(),
                    peer=peer, source=source)


class TracedWork:
    """An async work handle whose wait() also ends its recorded collective."""

    __slots__ = ("work", "token")

    def __init__(self, work, token):
        self.work, self.token = work, token

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        token, self.token = self.token, None
        collective_finished(token)
        return out

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        if done:
            token, self.token = self.token, None
            collective_finished(token)
        return done

    def __getattr__(self, name):
        return getattr(self.work, name)


def call(kind: str, group, tensor, fn, /, *args, source: str = "python", peer: int = -1, **kwargs):
    """Runs the blocking collective ``fn(*args, **kwargs)`` and records it."""
    token = collective_started(kind, group, tensor, source=source, peer=peer)
    out = fn(*args, **kwargs)
    collective_finished(token)
    return out


def traced(work, token):
    """``work`` itself while nothing records, else a TracedWork."""
    return work if token is None else TracedWork(work, token)
