"""vescale.explain: why an op on DTensors moved what it moved.

    e = vescale.explain(torch.matmul, a, b)    # runs the call; e.result is its result
    print(e)

    with vescale.explain.last(10) as e:        # the last 10 ops of a block
        loss = model(x)
    print(e)

For every aten op that reached the engine, the explanation shows the input placements,
the candidate shardings the op's rule weighed with their costs (the modelled time of
moving the inputs), the chosen one, the redistributions and collectives that were
issued (kind, mesh dim, bytes), the output placements, and whether the decision came
from the cache, from the replicate fallback (and why) or from a decomposition into
other ops (which then follow, indented). The decision is recomputed to be explained
(the cache is neither read nor changed), and the call itself runs as usual, so
``explain`` is collective like the call: every rank calls it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from . import _C

__all__ = ["explain", "Explanation"]

# How many decisions vescale.explain(fn, ...) keeps (a call of a whole model would run
# many ops; the earliest are dropped past this).
_CALL_CAPACITY = 10_000


class Explanation:
    """The engine's decisions for the ops of one call or block, oldest first.

    Each item (``_C.OpExplanation``) has ``op``, ``how`` ("rule", "fallback",
    "decomposed"), ``cache_hit``, ``fallback_reason``, ``inputs`` / ``outputs`` (dicts
    with ``name``, ``shape``, ``placements``, and for inputs ``target``, ``moves``,
    ``cost``), ``candidates`` (dicts with ``inputs``, ``outputs``, ``cost``, ``chosen``)
    and ``collectives`` (the recorder's event dicts), and ``str()``.
    """

    def __init__(self) -> None:
        self.decisions: list = []
        self.result: Any = None

    def __iter__(self):
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, i):
        return self.decisions[i]

    def ops(self) -> list[str]:
        return [d.op for d in self.decisions]

    def __str__(self) -> str:
        if not self.decisions:
            return "vescale.explain: no op on a DTensor ran"
        return "\n".join(str(d) for d in self.decisions)

    __repr__ = __str__


class _Explain:
    """``vescale.explain(fn, *args, **kwargs)`` and ``vescale.explain.last(n)``."""

    def __call__(self, fn: Callable, *args, **kwargs) -> Explanation:
        """Runs ``fn(*args, **kwargs)`` and explains every op on DTensors it dispatched
        (at most the last 10,000); the result is ``.result``."""
        if not callable(fn):
            raise TypeError(f"vescale.explain(fn, *args) takes the function to call first (e.g. "
                            f"vescale.explain(torch.matmul, a, b)), got {type(fn).__name__}; to explain "
                            f"the ops of a block, use `with vescale.explain.last(n) as e:`")
        out = Explanation()
        handle = _C.explain_begin(_CALL_CAPACITY)
        try:
            out.result = fn(*args, **kwargs)
        finally:
            out.decisions = _C.explain_end(handle)
        return out

    @contextlib.contextmanager
    def last(self, n: int = 20):
        """Explains the last ``n`` ops on DTensors that run in the ``with`` block (the
        Explanation fills in when the block ends)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"vescale.explain.last(n) keeps the last n decisions; n must be a positive int, "
                             f"got {n!r}")
        out = Explanation()
        handle = _C.explain_begin(n)
        try:
            yield out
        finally:
            out.decisions = _C.explain_end(handle)

    def __repr__(self) -> str:
        return "vescale.explain(fn, *args, **kwargs) / vescale.explain.last(n)"


explain = _Explain()
