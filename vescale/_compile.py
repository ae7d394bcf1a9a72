"""torch.compile on models that hold vescale DTensors: the DTensor regions run eagerly.

What Dynamo does with a tensor it meets (an argument, a parameter, a value live across a
graph break) is make a FakeTensor of it (``FakeTensorConverter.from_real_tensor``), which
describes the tensor's storage. A DTensor's C++ ``DTensorImpl`` has none (its storage
access throws), and it is not a traceable wrapper subclass either (op results are plain
``torch.Tensor`` objects made in C++, with no ``__tensor_flatten__``); Dynamo turned the
error into ``InternalTorchDynamoError`` and ``torch.compile(model)`` crashed.

Here fake-tensor conversion of a DTensor refuses the way torch refuses tensors it cannot
fake (quantized ones): inside a Dynamo compile it raises Dynamo's ``Unsupported``, which
is an ordinary graph break. The code around the DTensor runs eagerly, op by op through
vescale's dispatcher, as without ``torch.compile``; code on plain tensors around it still
compiles. Outside Dynamo (a ``FakeTensorMode`` of one's own) it raises torch's
``UnsupportedFakeTensorException`` with the same reason. The first refusal under Dynamo
warns once per process.

vescale's own Python layer (forward hooks of ``parallelize_module``, DTensor methods,
DDP, ...) only handles DTensors, so Dynamo is told to skip its files
(``torch._dynamo.trace_rules.add``) as soon as Dynamo is imported: calls into it are
graph breaks and its frames run eagerly, instead of Dynamo tracing into them until it
meets a vescale C++ function it cannot trace (and warning about each).

A DP model's mean cross-entropy weighs each rank by its targets (``global_loss.py``),
read from the loss's ``NllLossBackward0`` node; a loss computed inside a compiled graph
has the graph's node instead, and its divisor is gone. So once a ``ParallelModel`` with a
DP loss exists, ``keep_losses_eager`` tells Dynamo to graph-break at ``F.cross_entropy``
and ``F.nll_loss`` (``torch._dynamo.disallow_in_graph``, for the rest of the process):
the loss runs eagerly on the compiled logits, as one device's uncompiled loss would.

Both hooks use torch internals (pinned torch versions: 2.11 and 2.13); see
docs/engine.md, "torch.compile", for what a real compile mode would take.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorConverter, UnsupportedFakeTensorException

from . import _C

WARNING = (
    "vescale: torch.compile runs code that touches vescale DTensors eagerly. Dynamo cannot trace a "
    "DTensor (it has no storage for a FakeTensor to describe, and its ops are dispatched by vescale's "
    "C++ engine), so each region that handles one is a graph break and runs op by op through vescale's "
    "dispatcher, as without torch.compile; code on plain tensors still compiles. Results are those of "
    "the uncompiled run. (Warned once per process; see docs/engine.md, 'torch.compile'.)"
)
_GB_TYPE = "vescale DTensor"
_EXPLANATION = ("vescale DTensors run eagerly under torch.compile: a DTensorImpl has no storage for a FakeTensor "
                "to describe, and its ops are dispatched by vescale's C++ engine")

_warned = False
_plain_from_real_tensor = FakeTensorConverter.from_real_tensor


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(WARNING, UserWarning, stacklevel=2)


def _refuse(t: torch.Tensor):
    context = f"a DTensor of shape {tuple(t.shape)}, {t.placements} on {t.device_mesh}"
    if torch._guards.CompileContext.try_get() is not None and "torch._dynamo.exc" in sys.modules:
        from torch._dynamo import exc

        _warn_once()
        hints = ["Nothing to fix: the region runs eagerly and gives the results of the uncompiled model; "
                 "fullgraph=True cannot hold vescale DTensors."]
        try:
            exc.unimplemented(gb_type=_GB_TYPE, context=context, explanation=_EXPLANATION, hints=hints)
        except TypeError:  # a torch whose unimplemented() takes a message only
            raise exc.Unsupported(f"{_GB_TYPE}: {_EXPLANATION} ({context})") from None
    raise UnsupportedFakeTensorException(f"{context}: {_EXPLANATION}")


def _from_real_tensor(self, fake_mode, t, *args, **kwargs):
    if isinstance(t, torch.Tensor) and _C.is_dtensor(t):
        _refuse(t)
    return _plain_from_real_tensor(self, fake_mode, t, *args, **kwargs)


_losses_eager = False


def _skip_vescale_in_dynamo() -> None:
    from torch._dynamo import trace_rules

    if not trace_rules.check_file(__file__).skipped:
        trace_rules.add(__package__)
    if _losses_eager:
        _disallow_losses()


def _disallow_losses() -> None:
    import torch._dynamo
    import torch.nn.functional as F

    for fn in (F.cross_entropy, F.nll_loss):
        torch._dynamo.disallow_in_graph(fn)


def keep_losses_eager() -> None:
    """Dynamo graph-breaks at ``F.cross_entropy`` / ``F.nll_loss`` from now on (see the
    module docstring): a DP model's compiled loss keeps the node that says what it
    averaged over. Graphs Dynamo compiled before keep their loss."""
    global _losses_eager
    if _losses_eager:
        return
    _losses_eager = True
    if "torch._dynamo" in sys.modules:
        _disallow_losses()


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Calls ``_skip_vescale_in_dynamo`` right after ``torch._dynamo`` is imported: the import
    costs about a second, so vescale does not do it itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _skip_vescale_in_dynamo()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if FakeTensorConverter.from_real_tensor is not _from_real_tensor:
        FakeTensorConverter.from_real_tensor = _from_real_tensor
    if "torch._dynamo" in sys.modules:
        _skip_vescale_in_dynamo()
    elif not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())
