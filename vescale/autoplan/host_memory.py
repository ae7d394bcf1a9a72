"""How many bytes the process's CPU tensors hold, and the most they held over a span.

glibc's ``mallinfo2`` counts what malloc has handed out and not taken back, unlike the
resident set, which keeps what the allocator freed but did not return. The profile reads
it around a step; bench/autoplan.py and the memory test read a plan's peak with it.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
import torch.nn as nn

__all__ = ["PeakInUse", "in_use", "malloc_counted"]


class _MallInfo2:
    lib = None

    @classmethod
    def get(cls):
        if cls.lib is None:
            import ctypes

            class Info(ctypes.Structure):
                _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                           "fsmblks", "uordblks", "fordblks", "keepcost")]
            try:
                lib = ctypes.CDLL("libc.so.6")
                lib.mallinfo2.restype = Info
                lib.mallinfo2()
                cls.lib = lib
            except (OSError, AttributeError):
                cls.lib = False
        return cls.lib


def malloc_counted() -> bool:
    """Whether glibc's counters are there (``in_use`` is 0 where not)."""
    return bool(_MallInfo2.get())


def in_use() -> int:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2: in-use chunks and
    mmapped ones): the CPU tensors' memory, unlike the resident set, which keeps what the
    allocator freed but did not return. 0 where glibc is not there."""
    lib = _MallInfo2.get()
    if not lib:
        return 0
    m = lib.mallinfo2()
    return m.uordblks + m.hblkhd


# torch.distributed's collectives that PeakInUse(collectives=True) samples around
_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                "all_gather_single", "all_gather", "broadcast", "isend", "irecv", "send", "recv")


class PeakInUse:
    """The most bytes in use (``in_use``), sampled at every module's forward start and end,
    whenever a parameter's gradient is accumulated, and around every optimizer step; with
    ``collectives=True`` also just before and after every torch.distributed collective
    (a pipeline's gradient reduction after its schedule and ZeRO's gathers after the step
    hold buffers that no hook above sees; the engine's own collectives run inside ops)."""

    def __init__(self, collectives: bool = False):
        self.peak = 0
        self.handles = []
        self.collectives = collectives
        self._originals: dict = {}

    def sample(self, *args, **kwargs):
        self.peak = max(self.peak, in_use())

    def watch(self, model: nn.Module) -> "PeakInUse":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.sample()
        self.handles += [register_module_forward_pre_hook(self.sample), register_module_forward_hook(self.sample),
                         register_optimizer_step_pre_hook(self.sample), register_optimizer_step_post_hook(self.sample)]
        for p in model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self.sample))
        if self.collectives:
            self._originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
            for name, fn in self._originals.items():
                setattr(dist, name, self._sampled(fn))
        return self

    def _sampled(self, fn):
        @functools.wraps(fn)
        def sampled(*args, **kwargs):
            self.sample()
            out = fn(*args, **kwargs)
            self.sample()
            return out
        return sampled

    def close(self) -> int:
        self.sample()
        for h in self.handles:
            h.remove()
        self.handles = []
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals = {}
        return self.peak
