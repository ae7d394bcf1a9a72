"""deferred_init: build a model with its ordinary constructor without allocating it, and
later give each rank only its own shard, with the values one device would have had.

    model = vescale.deferred_init(GPT, config)          # parameters on the meta device
    parallelize_module(model, mesh["TP"], gpt_plan())    # each rank fills only its shards
    vescale.materialize_module(model)                    # whatever no plan covered, whole

The constructor runs on the meta device under a dispatch mode that records every aten
op (``normal_``, ``uniform_``, ``zero_``, ``fill_``, kaiming/xavier/trunc_normal, copies
from computed tensors, ``torch.manual_seed`` in between: the CPU generator state is
recorded before each random op). Materialising a tensor for a box (a rank's shard)
replays its ops:

* random fills (``normal_``, ``uniform_``, ``randn``, ``rand``) draw only the box's rows
  from the recorded generator state, the generator skipping the rest (``vescale/_random_streams.py``), in
  buffers of at most one 1 Mi-element chunk: bitwise the values of a single-device run,
  in memory of the box plus one chunk (fills whose use of the generator is not known,
  e.g. ``normal_`` on fewer than 16 elements, stream the whole sequence instead);
* ``trunc_normal_`` (torch's rejection sampler) streams its rounds chunk by chunk, the
  elements still rejected kept as bits (``stream_trunc_normal``); with bounds past 10
  std it never rejects and is drawn for the box like ``normal_``;
* pointwise ops with scalar arguments (``mul_``, ``add_``, ``clamp_``, ``erfinv_``,
  ``fill_``, ``zero_``) run on the box alone;
* anything else (a copy from a computed tensor, ``orthogonal_``, views) is replayed
  whole, then sliced: correct, at the cost of that one tensor in full.

While recording, the real generator is advanced exactly as the real constructor would
have (skipped, without drawing, where the fill's consumption is known), so whatever runs after
``deferred_init`` draws the same numbers as after an ordinary construction.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ._local import local_of
from ._random_streams import (RANDOM_FACTORIES, STREAMABLE, covers_storage, random_fill, stream,
                              stream_trunc_normal, trunc_normal)
from .boxes import Box, flat_range, whole

__all__ = ["deferred_init", "materialize_module", "is_deferred", "DeferredInitError", "cast_deferred",
           "swap_keeping_hooks"]

aten = torch.ops.aten
_POINTWISE_SCALAR = {aten.mul_.Scalar, aten.add_.Scalar, aten.sub_.Scalar, aten.div_.Scalar, aten.clamp_.default,
                     aten.erfinv_.default, aten.fill_.Scalar, aten.zero_.default, aten.mul_.Tensor,
                     aten.add_.Tensor, aten.div_.Tensor, aten.sub_.Tensor, aten.clamp_min_.default,
                     aten.clamp_max_.default, aten.neg_.default, aten.abs_.default, aten.sqrt_.default}
_FACTORIES = {aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default,
              aten.empty_strided.default}
_READS_VALUES = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default,
                 aten.is_nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
                 aten._unique2.default}


class DeferredInitError(RuntimeError):
    """The constructor needs parameter values (data-dependent control flow)."""


@dataclass
class _Node:
    seq: int
    func: object
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None  # the CPU generator state before a random op
    out: object = None
    python: bool = False      # a whole torch.nn.init function (see _PYTHON_INITS)


# torch.nn.init functions that return at once on meta tensors (trunc_normal_ also samples
# by rejection, a loop on values): recorded whole, replayed whole on the real tensor
_PYTHON_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@dataclass
class _History:
    """Everything that wrote one storage, in order."""
    nodes: list = field(default_factory=list)


_histories: dict[int, _History] = {}  # storage key -> history
_alive: dict[int, torch.Tensor] = {}  # storage key -> a meta alias of it


# storage key -> the version counter of the module's tensor over it when its recording
# ended: an in-place change after that (an init or an edit outside deferred_init, on a meta
# tensor) has no recording, and materialising would silently drop it (see _refuse_edited)
_versions: dict[int, int] = {}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


_sources: dict[int, object] = {}  # storage key -> read(box): values from a checkpoint instead


def is_deferred(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta and (_key(t) in _histories or _key(t) in _sources)


def bind_source(meta: torch.Tensor, read) -> None:
    """From now on the deferred tensor's values are ``read(box)`` (vescale.load into a
    deferred model): its recorded initialisation never runs."""
    _sources[_key(meta)] = read


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seq = 0
        self.keys: set[int] = set()  # the storages this recording wrote
        self.random: list[_Node] = []  # the random ops, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS_VALUES:
            raise DeferredInitError(
                f"the constructor reads tensor values ({func}) while vescale.deferred_init builds it on the "
                "meta device, where no values exist (data-dependent control flow). Build this model "
                "normally on one rank instead and scatter it: vescale.distribute_tensor(tensor, mesh, "
                "placements, src_data_rank=0) for each parameter, or parallelize_module on a model built "
                "with real values.")
        if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
            raise DeferredInitError(f"{func} with an explicit torch.Generator: vescale.deferred_init records "
                                    "the default CPU generator only; seed it with torch.manual_seed instead")
        rng = None
        if func in STREAMABLE or func in RANDOM_FACTORIES or torch.Tag.nondeterministic_seeded in func.tags:
            rng = torch.get_rng_state()
        out = func(*args, **kwargs)
        a, k, o = _aliases((args, kwargs, out))
        node = _Node(self.seq, func, a, k, rng, o)
        self.seq += 1
        if rng is not None:
            _advance(node)
            self.random.append(node)
        for t in _written(func, node.args, node.kwargs, node.out):
            _histories.setdefault(_key(t), _History()).nodes.append(node)
            _alive[_key(t)] = t
            self.keys.add(_key(t))
        return out


def _aliases(tree):
    """The recorded values with every meta tensor replaced by an alias of its own (same
    storage): the recording then never holds the user's tensors, which stay free to be
    swapped for materialised ones (torch.utils.swap_tensors)."""
    args, kwargs, out = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) and v.is_meta else v, tree)
    return args, kwargs, out


def _written(func, args, kwargs, out) -> list[torch.Tensor]:
    """The meta tensors an op creates or changes: outputs with storage of their own (not
    views), and mutated arguments."""
    schema = func._schema
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    written = [t for t, r in zip(outs, schema.returns) if isinstance(t, torch.Tensor) and t.is_meta
               and r.alias_info is None]
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_meta]
    return written


def deferred_init(module_cls, *args, **kwargs) -> nn.Module:
    """Runs ``module_cls(*args, **kwargs)`` on the meta device, recording how each
    parameter and buffer gets its values; nothing is allocated. With torch.distributed
    initialised every rank calls it (a collective): where the ranks' generators differ,
    rank 0's recorded states are taken, as a broadcast from rank 0 would give."""
    recorder = _Recorder()
    originals = {name: getattr(torch.nn.init, name) for name in _PYTHON_INITS}
    for name, fn in originals.items():
        setattr(torch.nn.init, name, _recorded_init(fn, recorder))
    try:
        with torch.device("meta"), recorder, _hugging_face_inits_on_meta():
            module = module_cls(*args, **kwargs)
    finally:
        for name, fn in originals.items():
            setattr(torch.nn.init, name, fn)
    # the recording lives as long as the module: then its storages may be reused
    weakref.finalize(module, _forget, frozenset(recorder.keys))
    _record_versions(module)
    _agree_random_states(recorder.random)
    return module


def _agree_random_states(nodes: list) -> None:
    """Rank 0's recorded generator states on every rank, where the ranks recorded the same
    construction from different states (seeded apart, for dropout or augmentation): the
    values a built model gets from DDP's or distribute_tensor's broadcast from rank 0. A
    shard or replica replays its tensors from these states, so without agreement replicas
    differed and shards came from different seeds. Collective over the default group when
    torch.distributed is initialised; ranks that recorded different numbers of random ops
    built different things (a pipeline stage each) and are left alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    digest = hashlib.sha256()
    for node in nodes:
        digest.update(node.rng.numpy().tobytes())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (len(nodes), digest.hexdigest()))
    if all(e == everyone[0] for e in everyone) or any(e[0] != everyone[0][0] for e in everyone):
        return
    states = [[node.rng for node in nodes] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(states, src=0)
    for node, state in zip(nodes, states[0]):
        node.rng = state


@contextlib.contextmanager
def _hugging_face_inits_on_meta():
    """transformers skips a model's own weight initialisation (``_init_weights``: the
    embeddings' and projections' std, zeroed biases) when the model is built on the meta
    device, where it expects a checkpoint to load; the recording would then hold the
    layers' default inits, not the values one device gets. While deferred_init records,
    ``PreTrainedModel.init_weights`` runs the initialisation anyway, where an ordinary
    build runs it (before the weights are tied); on meta tensors it is recorded like
    any other op."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    if base is None or not hasattr(base, "initialize_weights"):
        yield
        return
    original = base.init_weights

    def init_weights(self):
        self.initialize_weights()
        original(self)  # on meta: only ties the weights

    base.init_weights = init_weights
    try:
        yield
    finally:
        base.init_weights = original


def _forget(keys) -> None:
    for k in keys:
        _histories.pop(k, None)
        _alive.pop(k, None)
        _sources.pop(k, None)
        _versions.pop(k, None)


def _record_versions(module: nn.Module) -> None:
    for t in list(module.parameters()) + list(module.buffers()):
        if is_deferred(t):
            _versions[_key(t)] = t._version


def _refuse_edited(meta: torch.Tensor) -> None:
    """Raises where the deferred tensor was changed in place after its recording ended."""
    recorded = _versions.get(_key(meta))
    if recorded is not None and meta._version != recorded:
        raise DeferredInitError(
            f"a tensor of shape {tuple(meta.shape)} of a vescale.deferred_init model was changed in place after "
            "deferred_init returned (an init or an edit run on the model afterwards): its values do not exist "
            "until it is materialised, on the shards, and that change would be lost. Run it inside the "
            "recording, vescale.deferred_init(lambda: my_init(Model(config))), or after the model is "
            "materialised (after the first step of vescale.parallelize's model, or vescale.materialize_module)")


def _recorded_init(fn, recorder: _Recorder):
    def init(tensor, *args, **kwargs):
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return fn(tensor, *args, **kwargs)
        if kwargs.get("generator") is not None:
            raise DeferredInitError(f"torch.nn.init.{fn.__name__} with an explicit torch.Generator: "
                                    "vescale.deferred_init records the default CPU generator only")
        rng = torch.get_rng_state()
        a, k, out = _aliases(((tensor, *args), kwargs, tensor))
        node = _Node(recorder.seq, fn, a, k, rng, out, python=True)
        recorder.seq += 1
        recorder.random.append(node)
        with _disable_current_modes():
            _advance(node)
        _histories.setdefault(_key(tensor), _History()).nodes.append(node)
        _alive[_key(tensor)] = out
        recorder.keys.add(_key(tensor))
        return tensor
    return init


# ---- random streams (vescale/_random_streams.py) ---------------------------------------------

def _advance(node: _Node) -> None:
    """While recording: move the real generator past this random op."""
    fill = random_fill(node)
    if fill is not None and covers_storage(fill[2]):
        stream(node, tuple(fill[2].shape), fill[2].dtype, None, None)
        return
    trunc = trunc_normal(node)
    if trunc is not None:
        stream_trunc_normal(node.args[0], node.rng, trunc, None, None)
        return
    # any other random op: run it for real, whole (a transient tensor), just to advance
    torch.set_rng_state(node.rng)
    _replay_node(node, {})


# ---- materialisation --------------------------------------------------------------------------

def materialize(meta: torch.Tensor, box: Box | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
    """The values of a deferred tensor inside ``box`` (default: all of it), as a new CPU
    tensor, or written into ``into`` (of the box's sizes) and returned: a contiguous
    ``into`` is filled in place, with no temporary of the box's size."""
    _refuse_edited(meta)
    box = box or whole(meta.shape)
    if into is not None:
        if not into.is_contiguous():
            return into.copy_(materialize(meta, box))
        if tuple(into.shape) != tuple(box.sizes) or into.dtype != meta.dtype:
            raise ValueError(f"materialize: into is {tuple(into.shape)} {into.dtype}, the box is "
                             f"{tuple(box.sizes)} {meta.dtype}")
    if _key(meta) in _sources:
        values = _sources[_key(meta)](box)
        return values if into is None else into.copy_(values)
    if _key(meta) not in _histories:
        raise RuntimeError("vescale.deferred_init: this meta tensor's recording is gone (its module was "
                           "garbage collected); materialise a deferred model while it is alive")
    history = _histories[_key(meta)]
    if covers_storage(meta) and _local_ok(history, meta):
        out = torch.empty(box.sizes, dtype=meta.dtype, device="cpu") if into is None else into
        for node in history.nodes[_last_overwrite(history.nodes):]:
            if random_fill(node) is not None:
                stream(node, tuple(meta.shape), meta.dtype, box, out)
            elif node.python:  # trunc_normal_ (_local_ok let no other through)
                stream_trunc_normal(node.args[0], node.rng, trunc_normal(node), box, out)
            elif node.func in _FACTORIES:
                _replay_factory(node, out)
            else:
                _replay_pointwise(node, out)
        return out
    full = _replay_storage(_key(meta), seq=None)
    view = torch.as_strided(full, meta.shape, meta.stride(), meta.storage_offset())
    values = box.view_of(view, whole(meta.shape))
    return values.clone() if into is None else into.copy_(values)


def _last_overwrite(nodes: list) -> int:
    """The last op that sets every element regardless of earlier values (a random fill,
    fill_, zero_, a factory): what ran before it cannot matter. Constructors often init
    twice (nn.Linear's own kaiming_uniform_, then a model's _init_weights): one stream."""
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if (random_fill(n) is not None or n.func in _FACTORIES or n.func is aten.fill_.Scalar
                or n.func is aten.zero_.default or trunc_normal(n) is not None):
            return i
    return 0


def _local_ok(history: _History, meta: torch.Tensor) -> bool:
    """Whether every op of the history can run on a box alone."""
    for node in history.nodes:
        target = node.out if node.func in _FACTORIES or node.func in RANDOM_FACTORIES else node.args[0]
        if not isinstance(target, torch.Tensor) or not covers_storage(target):
            return False
        if node.func in _FACTORIES or random_fill(node) is not None or trunc_normal(node) is not None:
            continue
        if node.python or node.func not in _POINTWISE_SCALAR:
            return False
        if any(isinstance(a, torch.Tensor) and a.numel() > 1 for a in node.args[1:]):
            return False  # a tensor operand (not a 0-d scalar): replay whole
    return True


def _real(value, storages: dict):
    """A recorded argument on the CPU: meta tensors become views of replayed storages."""
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, torch.Tensor) and value.is_meta:
        key = _key(value)
        if key not in storages:
            storages[key] = _replay_storage(key, seq=None)
        return torch.as_strided(storages[key], value.shape, value.stride(), value.storage_offset())
    return value


def _replay_factory(node: _Node, out: torch.Tensor) -> None:
    if node.func is aten.zeros.default:
        out.zero_()
    elif node.func is aten.ones.default:
        out.fill_(1)
    elif node.func is aten.full.default:
        out.fill_(node.args[1])


def _replay_pointwise(node: _Node, out: torch.Tensor) -> None:
    args = tree_map(lambda a: (materialize(a) if a.is_meta else a).item() if isinstance(a, torch.Tensor) else a,
                    node.args[1:])
    node.func(out, *args, **node.kwargs)


def _replay_node(node: _Node, storages: dict):
    args = tree_map(lambda v: _real(v, storages), node.args)
    kwargs = tree_map(lambda v: _real(v, storages), node.kwargs)
    if node.rng is not None:
        torch.set_rng_state(node.rng)
    return node.func(*args, **kwargs)


def _replay_storage(key: int, seq) -> torch.Tensor:
    """The whole storage, replayed op by op on the CPU (flat, of the storage's dtype)."""
    history = _histories[key]
    meta = _alive.get(key)
    if meta is None:
        raise RuntimeError("vescale.deferred_init: a recorded tensor is gone; materialise before dropping it")
    flat = torch.empty(meta.untyped_storage().nbytes() // meta.element_size(), dtype=meta.dtype, device="cpu")
    storages = {key: flat}
    saved = torch.get_rng_state()
    try:
        for node in history.nodes:
            result = _replay_node(node, storages)
            if node.func in _FACTORIES or node.func in RANDOM_FACTORIES or not _mutates(node):
                out = node.out
                src = result if isinstance(result, torch.Tensor) else None
                if src is not None and _key(out) == key:
                    torch.as_strided(flat, out.shape, out.stride(), out.storage_offset()).copy_(src)
    finally:
        torch.set_rng_state(saved)
    return flat


def _mutates(node: _Node) -> bool:
    if node.python:
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in node.func._schema.arguments)


def materialize_module(module: nn.Module) -> nn.Module:
    """Every parameter and buffer still deferred becomes a whole CPU tensor, in place:
    a parameter keeps its identity (torch.utils.swap_tensors), so optimizers built on
    the deferred model hold the materialised ones. Tensors that parallelize_module or
    distribute_tensor sharded already are left alone."""
    done: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for name, t in list(owner._buffers.items()):
            if t is not None and is_deferred(t):
                if id(t) not in done:
                    done[id(t)] = materialize(t)
                owner._buffers[name] = done[id(t)]
        for t in owner._parameters.values():
            if t is not None and is_deferred(t) and id(t) not in done:
                done[id(t)] = t
                swap_keeping_hooks(t, nn.Parameter(materialize(t), requires_grad=t.requires_grad))
    return module


def cast_deferred(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for the floating-point tensors of a ``deferred_init`` model not
    materialised yet: each becomes a deferred tensor of ``dtype`` whose values are its
    own, cast as they are materialised (a rank still computes only its box). A plain
    ``.to`` makes new meta tensors with no recording behind them. Parameters keep their
    identity; other tensors are left to ``module.to``."""
    done: set[int] = set()
    keys = set()
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for t in table.values():
                if t is None or id(t) in done or not t.is_floating_point() or t.dtype == dtype or not is_deferred(t):
                    continue
                done.add(id(t))
                source = t.detach()
                cast = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
                bind_source(cast, lambda box, s=source: materialize(s, box).to(dtype))
                _alive[_key(cast)] = cast  # (its storage's address stays its key)
                keys.add(_key(cast))
                _refuse_edited(t)
                t.data = cast
                _versions[_key(cast)] = t._version  # (t keeps its own version counter)
    weakref.finalize(module, _forget, frozenset(keys))


def swap_keeping_hooks(t: torch.Tensor, new: torch.Tensor) -> None:
    """``torch.utils.swap_tensors(t, new)``, keeping the gradient hooks registered on ``t``.

    swap_tensors moves the data, not the autograd hooks: they stay with the TensorImpl
    that leaves, while ``t``'s Python dicts of hooks stay as they were, so the hooks look
    registered and never run. DDP's gradient hooks on a deferred model were lost that
    way when it was materialised, and the data-parallel ranks each stepped with their
    own gradients (found by the set-up fuzzer)."""
    post, pre = t._post_accumulate_grad_hooks, t._backward_hooks
    torch.utils.swap_tensors(t, new)
    if post:
        t._post_accumulate_grad_hooks = post  # (the setter installs the hook on the tensor)
    if pre:
        t._backward_hooks = pre


def flat_slice(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of ``t`` flattened (a ZeRO slice); for a deferred tensor
    only those elements are materialised."""
    if not is_deferred(t):
        return local_of(t).detach().reshape(-1)[start:end]
    parts = [materialize(t, b).reshape(-1) for b in flat_range(tuple(t.shape), start, end)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=t.dtype)


def materialize_before_reading(state) -> None:
    """Gives the deferred models in ``state`` (a module, or a dict of them and other
    things) their values now, as their first forward would (through DDP where it wraps
    one): saving or exporting reads them, and a model saved right after it was set up
    (a seed checkpoint) has not run yet. Loading binds deferred tensors instead."""
    for module in state.values() if isinstance(state, dict) else [state]:
        if not isinstance(module, nn.Module):
            continue
        for sub in module.modules():
            if getattr(sub, "deferred", False) is True and callable(getattr(sub, "materialize", None)):
                sub.materialize()  # DDP: its own bookkeeping too
        if has_deferred(module):
            materialize_module(module)


def has_deferred(module: nn.Module) -> bool:
    return any(is_deferred(t) for t in list(module.parameters()) + list(module.buffers()))
