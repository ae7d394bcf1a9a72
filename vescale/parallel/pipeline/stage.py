"""Running one stage of an unmodified model: the model's own ``forward``, in which only
the stage's units compute.

Hooks on every unit decide what it does while a stage runs:
- a unit of the stage runs as usual; at the stage's first block, the tensors received
  from the previous stage replace those the glue computed (the *boundary*);
- a unit of another stage before the boundary is *shadowed*: it runs on ``meta`` (its
  parameters swapped for meta twins), and its outputs become zeros of the right shape
  on the real device, so glue code (masks, rotary tables) keeps working. The zeros
  require grad when the real outputs would, which marks what derives from them: those
  are the tensors that cross the cut;
- the next stage's first block ends the stage: its tensor inputs that require grad are
  what the stage sends on (``StageEnd``); nothing after it runs.
A unit of another stage that runs after the boundary, or a shadow's zeros that reach
the stage's result, would make the result silently wrong: both raise
``PipelineSplitError`` naming the module and the split point.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .split import Layout, PipelineSplitError, Unit


@dataclass
class StageSpec:
    index: int
    start: int                 # blocks [start, end)
    end: int
    units: frozenset           # names of the units it owns
    first: bool
    last: bool
    split_point: str | None    # the block that starts it (None for the first stage)


class StageEnd(BaseException):
    """Raised at the next stage's first block (a BaseException, so that a model's
    ``except Exception`` does not swallow it)."""

    def __init__(self, positions: list[int], tensors: list[torch.Tensor]):
        super().__init__()
        self.positions, self.tensors = positions, tensors


@dataclass
class _Run:
    spec: StageSpec
    # (positions, tensors) to put in at the first block, or a function that receives them,
    # given the stand-ins the stage's own forward computed there
    received: tuple | Callable | None
    inside: bool                     # past the boundary: only the stage's own units may run
    meta: bool = False               # a dry run: every unit on meta (see StageRunner.dry_run)
    dummies: list = field(default_factory=list)   # (zeros, unit name)
    restores: list = field(default_factory=list)  # per open shadow: what to put back


_current: list[_Run | None] = [None]  # the stage run under way on this rank, if any


def on_stand_ins() -> bool:
    """True while a stage computes on stand-ins for values it does not have: every stage
    of the dry run, and a later stage's glue before its first block (where the zeros of
    another stage's units flow). A plain tensor there stands for a global value, not for
    this rank's shard (``parallelize_module``'s forward hooks read it so)."""
    run = _current[0]
    return run is not None and (run.meta or not run.inside)


def boundary_positions(leaves: list) -> list[int]:
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]


class StageRunner:
    """Installs the hooks once; ``run`` executes one stage on one micro-batch."""

    def __init__(self, model: nn.Module, layout: Layout, specs: list[StageSpec], local: list[int],
                 device: torch.device):
        self.model, self.layout, self.specs, self.device = model, layout, specs, device
        self.local_units = frozenset().union(*(specs[s].units for s in local))
        self._run: _Run | None = None
        self._twins: dict[int, tuple] = {}
        self._shadow_outputs = ShadowCache()
        self._handles = []
        self.install_hooks()

    def install_hooks(self) -> None:
        """(Re)installs the hooks: the pre-hook first and the post-hook last of each unit's
        hooks, around those parallelize_module adds later, which so see a shadow's meta
        values (and leave them alone) instead of its zeros."""
        self.remove()
        for unit in self.layout.units:
            m = unit.module
            if "forward" not in m.__dict__:  # once: see _forward
                m.forward = functools.partial(self._forward, unit, m.forward)
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(unit), with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(self._post_hook(unit), with_kwargs=True, always_call=True))

    def run(self, spec: StageSpec, args: tuple, kwargs: dict, received: tuple | Callable | None, meta: bool = False):
        """The model's forward on this micro-batch as stage ``spec``: returns
        ``("end", positions, tensors, dummies)`` for a stage that sends on, else
        ``("out", output, None, dummies)``. With ``meta`` every unit runs on meta tensors
        (``dry_run``)."""
        run = self._run = _current[0] = _Run(spec, received, inside=spec.first, meta=meta)
        try:
            output = self.model(*args, **kwargs)
        except StageEnd as end:
            if spec.last:
                raise
            return "end", end.positions, end.tensors, run.dummies
        except PipelineSplitError:
            raise
        except Exception as e:  # noqa: BLE001  (annotated and re-raised)
            if run.restores and not meta:
                e.add_note(f"[vescale pipeline] raised while running a module of another stage on meta tensors "
                           f"(for shapes); stage {spec.index} does not hold it")
            raise
        finally:
            for restore in reversed(run.restores):
                _put_back(restore)
            self._run = _current[0] = None
        if not spec.last:
            raise PipelineSplitError(
                f"stage {spec.index} ran the whole forward without reaching block "
                f"{self.layout.blocks[spec.end].name!r}, where the next stage starts: the model's forward does not "
                f"call its blocks one after the other")
        return "out", output, None, run.dummies

    def dry_run(self, specs: list[StageSpec], args, kwargs, finish) -> None:
        """Every stage in turn with every unit on meta (no compute in the units, no
        communication; the glue runs on zeros): a cut that cannot work raises here, on
        every rank alike, before any rank waits for another. ``finish(output)`` turns the
        last stage's output into its loss."""
        received = None
        for spec in specs:
            kind, a, b, dummies = self.run(spec, args, kwargs, received, meta=True)
            outputs = [t for t in b if t.requires_grad] if kind == "end" else [finish(a)]
            hit = reached_dummies(outputs, dummies)
            if hit:
                raise PipelineSplitError(
                    f"stage {spec.index} (from split point {spec.split_point!r}) uses the output of {hit[0]!r}, "
                    f"which runs on an earlier stage, other than through its first block's inputs: that value "
                    f"would have to cross the cut; choose split points that keep them together")
            if kind == "end":
                received = (a, [torch.zeros(t.shape, dtype=t.dtype, device=self.device).requires_grad_() for t in b])

    # ---- hooks ----

    def _pre_hook(self, unit: Unit):
        def hook(module, args, kwargs):
            run = self._run
            if run is None:
                if unit.name not in self.local_units:
                    raise RuntimeError(f"this model is split into pipeline stages and {unit.name!r} is not on this "
                                       f"rank; run it through the pipeline (PipelineParallel.step)")
                return None
            spec = run.spec
            if unit.block is not None and unit.block == spec.end and not spec.last:
                leaves, _ = tree_flatten((args, kwargs))
                positions = boundary_positions(leaves)
                raise StageEnd(positions, [leaves[i] for i in positions])
            if unit.name in spec.units:
                if unit.block == spec.start and not spec.first:
                    run.inside = True
                    args, kwargs = self._swap_in(run, unit, args, kwargs)
                    return self._shadow(run, module, args, kwargs, owned=True) if run.meta else (args, kwargs)
                if run.meta:
                    self._check_inputs(run, unit, args, kwargs)
                if not run.inside:
                    raise PipelineSplitError(
                        f"{unit.name!r} belongs to stage {spec.index} (it is registered after the blocks) but runs "
                        f"before the stage's first block {spec.split_point!r}: the model's forward calls it earlier "
                        f"than its place among the modules suggests; pass blocks= or other split points")
                return self._shadow(run, module, args, kwargs, owned=True) if run.meta else None
            if run.inside:
                raise PipelineSplitError(
                    f"{unit.name!r} runs after split point {spec.split_point!r} in stage {spec.index}, which does "
                    f"not hold it (it sits with the {'first' if unit.before else 'last'} stage by its place among "
                    f"the model's modules); this model cannot be cut there with {unit.name!r} on another stage")
            return self._shadow(run, module, args, kwargs)
        return hook

    def _post_hook(self, unit: Unit):
        def hook(module, args, kwargs, output):
            run = self._run
            if run is None or not run.restores or run.restores[-1][0] is not module:
                return None
            _, _, owned = run.restores[-1]
            _put_back(run.restores.pop())
            if output is None:  # the forward raised
                return None

            def zeros(t):  # meta -> zeros on the device; another stage's are marked
                if isinstance(t, torch.Tensor) and t.is_meta:
                    # one zero seen through stride-0 dims: no memory, no fill (ops on it
                    # allocate their results; in-place ops on it fail as on any leaf)
                    z = torch.zeros((), dtype=t.dtype, device=self.device).expand(t.shape)
                    if t.requires_grad:
                        z.requires_grad_()
                        if not owned:
                            run.dummies.append((z, unit.name))
                    return z
                return t
            return tree_map(zeros, output)
        return hook

    def _forward(self, unit: Unit, original, *args, **kwargs):
        """A unit's forward. A shadow (another stage's unit, on meta) with inputs of shapes
        seen before returns meta outputs of the shapes it gave then, without running:
        meta kernels are Python decompositions, and running every earlier stage's blocks
        on meta for every micro-batch cost more than the stage's own work."""
        run = self._run
        if run is None or not run.restores or run.restores[-1][0] is not unit.module or run.restores[-1][2]:
            return original(*args, **kwargs)
        return self._shadow_outputs(unit.name, original, args, kwargs)

    def _check_inputs(self, run: _Run, unit: Unit, args, kwargs) -> None:
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        hit = reached_dummies(leaves, run.dummies)
        if hit:
            raise PipelineSplitError(
                f"{unit.name!r} in stage {run.spec.index} (from split point {run.spec.split_point!r}) takes a value "
                f"computed by {hit[0]!r} on an earlier stage that does not come through the stage's first block: it "
                f"would have to cross the cut; choose split points that keep them together")

    def _swap_in(self, run: _Run, unit: Unit, args, kwargs):
        leaves, tree = tree_flatten((args, kwargs))
        positions = boundary_positions(leaves)
        if not positions:
            # what crosses a cut is told by requires_grad (module docstring): an earlier
            # stage whose result does not require grad would send nothing, and this stage
            # would compute on its stand-in zeros, silently
            raise PipelineSplitError(
                f"stage {run.spec.index} (from split point {run.spec.split_point!r}) would receive nothing from the "
                f"stage before: no input of {unit.name!r} requires grad, so the earlier stages' result does not (their "
                f"parameters are all frozen, or reentrant activation checkpointing over an input that does not "
                f"require grad hides them, which on one device leaves those blocks without gradients too). A "
                f"pipeline needs the values that cross a cut to require grad: train a parameter before the cut, "
                f"split after the frozen blocks, use use_reentrant=False, or make the input require grad (Hugging "
                f"Face: model.enable_input_require_grads())")
        received = run.received
        got_positions, tensors = received([leaves[i] for i in positions]) if callable(received) else received
        if positions != list(got_positions):
            raise PipelineSplitError(
                f"stage {run.spec.index} expects tensors at input positions {positions} of {unit.name!r} from the "
                f"previous stage but received positions {list(got_positions)}: the stages disagree on what crosses "
                f"split point {run.spec.split_point!r}")
        for i, t in zip(positions, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, tree)

    def _shadow(self, run: _Run, module: nn.Module, args, kwargs, owned: bool = False):
        restore = []
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, t in table.items():
                    if t is not None and not t.is_meta:
                        table[name] = self._twin(t)
                        restore.append((table, name, t))
        run.restores.append((module, restore, owned))
        return tree_map(_to_meta, (args, kwargs))

    def _twin(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._twins.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        twin = _meta_copy(t)
        self._twins[id(t)] = (t, twin)
        return twin

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _meta_copy(t: torch.Tensor) -> nn.Parameter | torch.Tensor:
    """A meta tensor of ``t``'s (global) shape and dtype; a parameter stays a parameter and
    keeps requires_grad, so a shadow's outputs require grad as the real ones would."""
    twin = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin


def meta_twin_of(t: torch.Tensor) -> nn.Parameter | torch.Tensor:
    """What stays of a tensor another stage owns: its meta copy, marked (``is_elsewhere``)."""
    twin = _meta_copy(t)
    twin._vescale_pp_elsewhere = True
    return twin


def is_elsewhere(t: torch.Tensor) -> bool:
    """A parameter or buffer that another pipeline stage holds."""
    return getattr(t, "_vescale_pp_elsewhere", False)


_SHADOW_CACHE = 4096
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


class _MetaSpec(tuple):
    """(shape, dtype, requires_grad) of a meta output."""


def _cacheable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta or isinstance(x, _PLAIN)


def _spec_of(x):
    return _MetaSpec((tuple(x.shape), x.dtype, x.requires_grad)) if isinstance(x, torch.Tensor) else x


class ShadowCache:
    """A shadow's forward by the shapes of its inputs: called with inputs of a signature
    seen before (``_signature``), it returns meta outputs of the shapes it gave then
    without running; the planner's profile times shadows through it too."""

    def __init__(self):
        self._outputs: dict = {}

    def __call__(self, name: str, original, args, kwargs):
        key = _signature(name, args, kwargs)
        if key is not None and key in self._outputs:
            leaves, tree = self._outputs[key]
            return tree_unflatten([_meta_of(x) for x in leaves], tree)
        out = original(*args, **kwargs)
        leaves, tree = tree_flatten(out)
        if key is not None and all(_cacheable(x) for x in leaves):
            if len(self._outputs) >= _SHADOW_CACHE:
                self._outputs.pop(next(iter(self._outputs)))
            self._outputs[key] = ([_spec_of(x) for x in leaves], tree)
        return out

    def wrap(self, name: str, original):
        """``original`` (a module's forward) through the cache."""
        return lambda *args, **kwargs: self(name, original, args, kwargs)


def _meta_of(x):
    if isinstance(x, _MetaSpec):
        shape, dtype, grad = x
        t = torch.empty(shape, dtype=dtype, device="meta")
        return t.requires_grad_() if grad else t
    return x


def _signature(name: str, args, kwargs):
    """What a shadow's output shapes can depend on, or None when an argument is an object
    whose state might (a KV cache, say): such calls always run."""
    leaves, tree = tree_flatten((args, kwargs))
    key = [name, str(tree)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype, x.requires_grad))
        elif isinstance(x, _PLAIN):
            key.append(x)
        else:
            return None
    return tuple(key)


def _to_meta(x):
    if not isinstance(x, torch.Tensor) or x.is_meta:
        return x
    m = torch.empty(x.shape, dtype=x.dtype, device="meta")
    return m.requires_grad_() if x.requires_grad else m


def _put_back(entry) -> None:
    _, restore, _ = entry
    for table, name, t in restore:
        table[name] = t


def reached_dummies(roots: list[torch.Tensor], dummies: list) -> list[str]:
    """Units whose shadow zeros the autograd graph of ``roots`` reaches."""
    if not dummies:
        return []
    by_id = {id(z): name for z, name in dummies}
    seen, stack, hit = set(), [t.grad_fn for t in roots if t.grad_fn is not None], []
    for t in roots:
        if id(t) in by_id:
            hit.append(by_id[id(t)])
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None and id(var) in by_id:
            hit.append(by_id[id(var)])
        stack.extend(n for n, _ in node.next_functions)
    return sorted(set(hit))
