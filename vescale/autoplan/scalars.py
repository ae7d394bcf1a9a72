"""Values a model reads out of its tensors, recorded on the profiled run and replayed in
the what-if runs on meta tensors.

Model code sometimes branches on data: Hugging Face's mask code asks whether the
position ids describe packed sequences (``(mask[:, -1] == 0).all()``) when a model trains
without a KV cache. A meta tensor holds no data, so such a read (``aten::_local_scalar_dense``:
``item()``, ``bool()``, ``int()``) fails there. The profile runs the model for real on the
same kind of batch: what it read is kept per place in the model's code (file and line)
and dtype, and the what-if runs take those values back where a meta tensor is read.

A place that always read the same value replays it however often it is reached (the
what-if runs some parts of the model more often, or on a smaller batch); a place that read
different values replays them in order and refuses to go past them. A place the profile
never reached is an error that names it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ScalarTape", "replaying", "replays_profile"]

_READ = torch.ops.aten._local_scalar_dense.default
# frames inside these are not the model's: the place of a read is the first frame outside
_LIBRARIES = (os.path.dirname(torch.__file__) + os.sep,
              os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)  # vescale


def _place() -> tuple[str, int]:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)


class ScalarTape(TorchDispatchMode):
    """``ScalarTape()`` records every value read out of a tensor while it is entered;
    ``ScalarTape(values)`` gives those values back for reads of meta tensors."""

    def __init__(self, values: dict | None = None):
        super().__init__()
        self.recording = values is None
        self.values: dict[tuple, list] = {} if values is None else values
        self._next: dict[tuple, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _READ:
            return func(*args, **kwargs)
        t = args[0]
        if not self.recording and not t.is_meta:
            return func(*args, **kwargs)
        key = (*_place(), str(t.dtype))
        if not self.recording:
            return self._replay(key)
        value = func(*args, **kwargs)
        self.values.setdefault(key, []).append(value)
        return value

    def _replay(self, key: tuple):
        where = f"{key[0]}:{key[1]} ({key[2]})"
        seen = self.values.get(key)
        if not seen:
            raise RuntimeError(f"the what-if run on meta tensors reads a value out of a tensor at {where}, which the "
                               "profiled run never read there; the planner cannot know it. Profile with a batch "
                               "that takes the same path through the model")
        if all(v == seen[0] for v in seen):
            return seen[0]
        i = self._next[key]
        if i >= len(seen):
            raise RuntimeError(f"the what-if run on meta tensors reads a value out of a tensor at {where} more often "
                               f"({i + 1} times) than the profiled run did ({len(seen)}), and those values differ: "
                               "the planner cannot know the next one")
        self._next[key] = i + 1
        return seen[i]


_TAPE: list[dict | None] = [None]  # the values what_if() replays (vescale.autoplan.virtual)


@contextlib.contextmanager
def replaying(values: dict | None):
    """While open, what-if runs on meta tensors take reads of values from ``values``."""
    old, _TAPE[0] = _TAPE[0], values
    try:
        yield
    finally:
        _TAPE[0] = old


def replay_mode():
    """The mode a what-if run enters: nothing when the profile read no values."""
    return ScalarTape(_TAPE[0]) if _TAPE[0] else contextlib.nullcontext()


def replays_profile(fn):
    """For a function whose first argument is the Profile: its what-if runs replay the
    values that profile read."""
    @functools.wraps(fn)
    def run(profile, *args, **kwargs):
        with replaying(profile.scalars):
            return fn(profile, *args, **kwargs)
    return run
