"""What a rank saves and loads: the user's dict flattened into tensor items (global
tensors, of which this rank holds some boxes) and objects (everything else).

Keys are stable across meshes, world sizes and ZeRO stages, which is what makes a
checkpoint reshardable: ``model.<param fqn>``, ``optimizer.state.<param key>.<state>``
(the same for a plain torch optimizer and a DistributedOptimizer), and
``optimizer.master.<param key>`` for ZeRO's fp32 master weights. A PipelineParallel
model has its model's own names (no ``module.`` prefix); each rank holds its stages'
tensors, and the other stages' keys are in ``Layout.elsewhere``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..deferred import is_deferred
from ..dtensor import DTensor, shard_parts as dtensor_shard_parts
from ..parallel.ddp import DDP, local_of
from ..parallel.optimizer import DistributedOptimizer
from ..parallel.pipeline.engine import is_pipeline  # names without its "module." prefix
from ..parallel.pipeline.stage import is_elsewhere
from ..train import ParallelModel, ParallelOptimizer
from ..boxes import Box, flat_range, whole


@dataclass
class Piece:
    box: Box              # in global coordinates
    tensor: torch.Tensor  # of box.sizes: a view of the live storage (load writes through it)


@dataclass
class Item:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    source: str = "plain"   # the placements and mesh it lives on here (recorded in the manifest)
    optional: bool = False  # loading goes on without it (ZeRO masters: taken from the parameters)


@dataclass
class Layout:
    items: dict[str, Item] = field(default_factory=dict)
    objects: dict[str, object] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameters: second name -> first
    # to restore objects on load: key -> callable(value)
    restore: dict[str, object] = field(default_factory=dict)
    # to check an object before a load changes anything: key -> callable(value) -> problem or None
    validate: dict[str, object] = field(default_factory=dict)
    # optimizer state made for a load (the optimizer has not stepped yet), put in place only
    # once every rank has verified the checkpoint: callables
    installs: list = field(default_factory=list)
    # objects that differ by rank and are saved combined: key -> callable(list of the ranks' values)
    merge: dict[str, object] = field(default_factory=dict)
    # keys of tensors that other pipeline stages hold (meta here): neither saved nor loaded by this rank
    elsewhere: set[str] = field(default_factory=set)
    optimizers: list[str] = field(default_factory=list)  # keys of the optimizers in the state
    # after a load has written every tensor: callables (Partial tensors take their addends)
    finishes: list = field(default_factory=list)

    def held_elsewhere(self, key: str) -> bool:
        """Whether ``key`` (a checkpoint key) belongs to another pipeline stage's tensor:
        the tensor itself, or its optimizer state or ZeRO master weight."""
        if not self.elsewhere:
            return False
        if key in self.elsewhere:
            return True
        for opt in self.optimizers:
            if key.startswith(f"{opt}.state.") and key[len(opt) + 7:].rpartition(".")[0] in self.elsewhere:
                return True
            if key.startswith(f"{opt}.master.") and key[len(opt) + 8:] in self.elsewhere:
                return True
        return False


def unwrap(module: nn.Module) -> nn.Module:
    if isinstance(module, ParallelModel):  # what vescale.parallelize returns
        module = module.module
    return module.module if isinstance(module, DDP) else module


def shard_parts(t: torch.Tensor) -> list[tuple[Box, Box]]:
    """This rank's shard of a DTensor (or the whole of a plain tensor) as (box of the shard,
    box of the global tensor) pairs: one, or several for InterleavedShard dims."""
    return dtensor_shard_parts(t) if isinstance(t, DTensor) else [(whole(t.shape), whole(t.shape))]


def _global(part: tuple[Box, Box], box: Box) -> Box:
    """``box``, a box of the shard inside ``part``'s shard box, in global coordinates."""
    shard_box, global_box = part
    return box.shifted(tuple(g - s for g, s in zip(global_box.offsets, shard_box.offsets)))


def describe(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"{list(t.placements)} on mesh {t.device_mesh.shape}"
    return "plain"


def flat_pieces(parts: list[tuple[Box, Box]], shard_shape, flat: torch.Tensor, start: int) -> list[Piece]:
    """Pieces for ``flat``, the elements [start, start + numel) of a shard (of ``shard_shape``,
    made of ``parts``) in row-major order."""
    pieces, pos = [], 0
    for b in flat_range(tuple(shard_shape), start, start + flat.numel()):
        n = b.numel()
        values = flat[pos:pos + n].view(b.sizes)
        for part in parts:
            if len(parts) == 1:
                pieces.append(Piece(_global(part, b), values))
            elif (inside := b.intersect(part[0])) is not None:
                pieces.append(Piece(_global(part, inside), inside.view_of(values, b)))
        pos += n
    return pieces


def build(state: dict, saved: dict | None = None) -> Layout:
    """The layout of ``state``; it changes nothing in ``state``. For a load, ``saved`` is
    the checkpoint's {key: (shape, dtype)}: optimizer state it has but the optimizer has
    not created yet (no step taken) is made, to be filled, and put in place by
    ``Layout.installs``."""
    layout = Layout()
    fqn_of: dict[int, str] = {}
    zero3: dict[int, tuple] = {}  # param id -> (slice tensor, start): ZeRO-3 parameters live as slices
    for key, value in state.items():
        if isinstance(value, nn.Module):
            for name, p in unwrap(value).named_parameters(remove_duplicate=True):
                fqn_of.setdefault(id(p), f"{key}.{name}")
            for sub in value.modules():  # a ZeRO-3 model saved or loaded without its optimizer
                sharded = getattr(sub, "sharded_parameters", None)
                for e in sharded.sharded.values() if sharded is not None else []:
                    zero3[id(e.param)] = (e.slice, e.start)
        if isinstance(value, ParallelOptimizer):
            value = value.inner
        if isinstance(value, DistributedOptimizer) and value.sharded is not None:
            for o in value.owned:
                zero3[id(o.param)] = (value.sharded.slice_of(o.param), o.start)
    for key, value in state.items():
        if isinstance(value, ParallelOptimizer):  # what vescale.parallelize returns
            value = value.inner
        if isinstance(value, nn.Module):
            _module(layout, key, unwrap(value), zero3)
        elif isinstance(value, DistributedOptimizer):
            layout.optimizers.append(key)
            _zero_optimizer(layout, key, value, fqn_of, saved)
        elif isinstance(value, torch.optim.Optimizer):
            layout.optimizers.append(key)
            _optimizer(layout, key, value, fqn_of, saved)
        elif isinstance(value, torch.Tensor):
            _tensor(layout, key, value)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            layout.objects[key] = value.state_dict()
            layout.restore[key] = value.load_state_dict
            check = getattr(value, "check_state_dict", None)  # e.g. vescale.DataLoader: a problem or None
            if callable(check):
                layout.validate[key] = lambda saved, c=check, k=key: (
                    None if (problem := c(saved)) is None else f"'{k}': {problem}")
        else:
            layout.objects[key] = value
            layout.restore[key] = lambda v, k=key: state.__setitem__(k, v)
    return layout


def _tensor(layout: Layout, key: str, t: torch.Tensor, *, optional: bool = False) -> None:
    t = t.detach()
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        t = _reduced(layout, t)
    local = local_of(t)
    pieces = [Piece(global_box, shard_box.view_of(local, whole(local.shape))) for shard_box, global_box in shard_parts(t)]
    layout.items[key] = Item(key, tuple(t.shape), t.dtype, pieces, describe(t), optional)


def _reduced(layout: Layout, t: DTensor) -> DTensor:
    """A Partial DTensor's shards are addends; a checkpoint holds their reduction (its
    value). Saved from the reduced tensor, and loaded into it: a load then gives ``t`` the
    value as addends again (the whole value on one rank of each Partial(sum) mesh dim and
    zeros on the others; the value itself for avg, max and min)."""
    from ..placement_types import Replicate
    value = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])

    def as_addends():
        coordinate = t.device_mesh.get_coordinate()
        keeps = all(coordinate[m] == 0 for m, p in enumerate(t.placements)
                    if p.is_partial() and p.reduce_op == "sum")
        local = local_of(t)
        local.copy_(local_of(value)) if keeps else local.zero_()

    layout.finishes.append(as_addends)
    return value


def _module(layout: Layout, key: str, module: nn.Module, zero3: dict) -> None:
    if is_pipeline(module):  # the other stages' tensors: their holders save and load them
        inner = module.module
        named = list(inner.named_parameters(remove_duplicate=False)) + list(inner.named_buffers(remove_duplicate=False))
        layout.elsewhere.update(f"{key}.{n}" for n, t in named if is_elsewhere(t))
    seen: dict[int, str] = {}
    named = list(module.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if _persistent(module, n)]
    for name, t in named:
        full = f"{key}.{name}"
        if id(t) in seen:
            layout.aliases[full] = seen[id(t)]
            continue
        seen[id(t)] = full
        if id(t) in zero3:
            flat, start = zero3[id(t)]
            layout.items[full] = Item(full, tuple(t.shape), t.dtype,
                                      flat_pieces(shard_parts(t), local_of(t).shape, flat, start),
                                      describe(t) + ", ZeRO-3 slice")
        else:
            _tensor(layout, full, t)


def _persistent(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)  # a pipeline's "" is the model it runs
    return leaf not in sub._non_persistent_buffers_set


def _param_key(p, fqn_of: dict, opt_key: str) -> str:
    if id(p) not in fqn_of:
        raise ValueError(f"'{opt_key}' optimizes a parameter of no module in this dict: put the model in the "
                         f"same vescale.save/load dict as its optimizer (e.g. {{'model': model, '{opt_key}': opt}})")
    return fqn_of[id(p)]


def _groups(groups: list[dict], key_of) -> list[dict]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [key_of(p) for p in g["params"]]}
            for g in groups]


def _param_groups(layout: Layout, key: str, opt: torch.optim.Optimizer, key_of) -> None:
    def validate(saved) -> str | None:
        if len(saved) != len(opt.param_groups):
            return f"'{key}': the checkpoint has {len(saved)} parameter groups, the optimizer {len(opt.param_groups)}"
        return None

    def restore(saved: list[dict]) -> None:
        for group, values in zip(opt.param_groups, saved):
            group.update({k: v for k, v in values.items() if k != "params"})

    name = f"{key}.param_groups"
    layout.objects[name] = _groups(opt.param_groups, key_of)
    layout.validate[name] = validate
    layout.restore[name] = restore
    layout.merge[name] = _merge_groups


def _merge_groups(per_rank: list[list[dict]]) -> list[dict]:
    """The parameter groups of the whole model from every rank's (a pipeline stage or a
    ZeRO rank optimizes some parameters only): the first rank's hyperparameters, and per
    group the keys of every rank's parameters, each once, in rank order."""
    merged = []
    for i, first in enumerate(per_rank[0]):
        params, seen = [], set()
        for groups in per_rank:
            for k in groups[i]["params"] if i < len(groups) else []:
                if k not in seen:
                    seen.add(k)
                    params.append(k)
        merged.append(dict(first, params=params))
    return merged


def _state_tensor(shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A fresh optimizer-state tensor for a load: the parameter's layout, or a scalar."""
    if tuple(shape) == ():
        return torch.zeros((), dtype=dtype)
    if is_deferred(like):  # its parameter is materialised later, on the CPU: the state is
        # read now, there (on meta, as the parameter is, the loaded values were dropped)
        return torch.zeros(like.shape, dtype=dtype)
    return torch.zeros_like(like, dtype=dtype)


def _state_of(layout: Layout, opt_state: dict, target, param_key: str, opt_key: str, saved: dict | None,
              like) -> dict:
    """The optimizer state of ``target``: its own, or for a load, state the checkpoint
    has and the optimizer has not made yet, installed only when the load goes ahead."""
    if saved is None or opt_state.get(target):
        return opt_state.get(target, {})
    prefix = f"{opt_key}.state.{param_key}."
    names = [k[len(prefix):] for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]]
    made = {n: _state_tensor(*saved[prefix + n], like) for n in names}
    if made:
        layout.installs.append(lambda: opt_state.__setitem__(target, made))
    return made


def _optimizer(layout: Layout, key: str, opt: torch.optim.Optimizer, fqn_of: dict, saved: dict | None) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            pk = _param_key(p, fqn_of, key)
            state = _state_of(layout, opt.state, p, pk, key, saved, p.detach())
            for name, v in state.items():
                if isinstance(v, torch.Tensor):
                    _tensor(layout, f"{key}.state.{pk}.{name}", v)
                else:
                    layout.objects[f"{key}.state.{pk}.{name}"] = v
                    layout.restore[f"{key}.state.{pk}.{name}"] = lambda x, s=state, n=name: s.__setitem__(n, x)
    _param_groups(layout, key, opt, lambda p: _param_key(p, fqn_of, key))


def _zero_optimizer(layout: Layout, key: str, opt: DistributedOptimizer, fqn_of: dict, saved: dict | None) -> None:
    key_of_master = {}
    for o in opt.owned:
        pk = _param_key(o.param, fqn_of, key)
        key_of_master[id(o.master)] = pk
        parts, shard_shape = shard_parts(o.param), local_of(o.param).shape
        shape, src = tuple(o.param.shape), describe(o.param) + f", ZeRO-{opt.zero_stage} slice"
        layout.items[f"{key}.master.{pk}"] = Item(f"{key}.master.{pk}", shape, o.master.dtype,
                                                  flat_pieces(parts, shard_shape, o.master.detach(), o.start), src,
                                                  optional=True)
        state = _state_of(layout, opt.inner.state, o.master, pk, key, saved, o.master.detach())
        for name, v in state.items():
            k = f"{key}.state.{pk}.{name}"
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                layout.items[k] = Item(k, (), v.dtype, [Piece(Box((), ()), v)], "plain")
            elif isinstance(v, torch.Tensor):
                layout.items[k] = Item(k, shape, v.dtype, flat_pieces(parts, shard_shape, v, o.start), src)
            else:
                layout.objects[k] = v
                layout.restore[k] = lambda x, s=state, n=name: s.__setitem__(n, x)
    _param_groups(layout, key, opt.inner, lambda m: key_of_master[id(m)])
    if opt.scaler is not None:
        layout.objects[f"{key}.loss_scale"] = opt.scaler.state_dict()
        layout.restore[f"{key}.loss_scale"] = opt.scaler.load_state_dict

