"""parallelize_module: shard an unmodified nn.Module by a plan of FQN patterns.

    plan = {
        "parameter": {r"h\\.\\d+\\.mlp\\.c_fc\\.weight": [Shard(0)], ...},
        "forward": {r"h\\.\\d+\\.mlp\\.input": [[Replicate()]],
                    r"h\\.\\d+\\.mlp\\.output": [[Replicate()]]},
    }
    parallelize_module(model, mesh["TP"], plan)

Patterns are regular expressions matched against the whole fully qualified name.
Parameters (and buffers) become DTensor ``nn.Parameter``s in place; those no pattern
names are replicated. ``<module>.input`` / ``<module>.output`` keys give, per
positional argument / result, the placements to move it to (None leaves it alone):
DTensors are redistributed, plain tensors are taken as this rank's shard
(``DTensor.from_local``). This happens in forward hooks; the module's class and
methods are untouched.

The whole plan is checked before anything changes: a malformed entry (wrong nesting,
strings or other objects for placements, a wrong count for the mesh, a bad key, a
pattern that matches nothing) raises a TypeError or ValueError that quotes the key and
shows the right form, e.g. ``{'mlp\\\\.fc1\\\\.output': [[Replicate()]]}`` (as the messages
print keys: backslashes doubled).
"""

from __future__ import annotations

import difflib
import re
from typing import Sequence

import torch
import torch.nn as nn

from .. import _C
from ..boxes import whole
from ..device_mesh import DeviceMesh
from ..dtensor import DTensor, _shard_parts, distribute_tensor
from ..placement_types import InterleavedShard, Placement, Replicate, Shard, to_c
from .pipeline.stage import is_elsewhere, on_stand_ins
from .tp_grads import PartialGradients

__all__ = ["parallelize_module"]

# Set by vescale.autoplan's what-if runs (meta tensors over a fake process group): meta
# parameters become meta DTensor shards and the forward hooks move meta DTensors, so the
# engine issues (to the fake group, and to the collective recorder) what a real run would.
_WHAT_IF = [False]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, sharding_plan: dict) -> nn.Module:
    """Shards ``module`` in place on ``device_mesh`` following ``sharding_plan``; returns it.

    The whole plan is checked before the module is touched: a malformed entry raises a
    ``TypeError`` (wrong kind of value) or ``ValueError`` (wrong count, no match, bad key)
    that quotes the key, says what was expected and shows the right form, and the module
    stays as it was. Shard dims of activations are checked when the hooks run."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module, got {type(module).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"parallelize_module expects a vescale.DeviceMesh (e.g. mesh['TP']), got "
                        f"{type(device_mesh).__module__}.{type(device_mesh).__name__}")
    parameter_rules, forward_rules = _checked_plan(sharding_plan, device_mesh)
    assignments = _parameter_assignments(module, device_mesh, parameter_rules)
    hooks = _hook_targets(module, device_mesh, forward_rules)
    _distribute_parameters(assignments, device_mesh)
    _install_forward_hooks(hooks, device_mesh)
    PartialGradients.install(module)  # replicated parameters' Partial gradients, bucketed
    return module


# ---- the plan's form, checked before anything changes -------------------------------------

_SECTIONS = ("parameter", "forward")
_PLACEMENT_FORMS = "Shard(d), Replicate(), Partial() or InterleavedShard(d, groups), from vescale"
_PARAM_KEY = r"mlp\.fc1\.weight"  # the keys of examples in messages
_FORWARD_KEY = r"mlp\.fc1\.output"


def _param_example(key: str, mesh: DeviceMesh) -> str:
    placements = ", ".join(["Replicate()"] * (mesh.ndim - 1) + ["Shard(0)"])
    return f"{{{key!r}: [{placements}]}}"


def _forward_example(key: str, mesh: DeviceMesh) -> str:
    placements = ", ".join(["Replicate()"] * mesh.ndim)
    return f"{{{key!r}: [[{placements}]]}}"


def _plan_example(mesh: DeviceMesh) -> str:
    return f"{{'parameter': {_param_example(_PARAM_KEY, mesh)}, 'forward': {_forward_example(_FORWARD_KEY, mesh)}}}"


def _describe(value) -> str:
    if isinstance(value, Placement):
        return f"{value!r}, a single placement instead of a list"
    if isinstance(value, dict):
        return f"a dict {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{value!r} (of type {type(value).__name__})"


def _checked_placement(p, what: str, expected: str) -> Placement:
    if isinstance(p, Placement):
        return p
    if isinstance(p, str):
        problem = f"{p!r} is a string, not a placement: write the object ({_PLACEMENT_FORMS}), e.g. Shard(0)"
    elif isinstance(p, type) and issubclass(p, Placement):
        problem = f"{p.__name__} is the class, not a placement: write {p.__name__}({'0' if p is Shard else ''})"
    elif type(p).__module__.startswith("torch.distributed"):
        problem = (f"{p!r} is torch.distributed.tensor's {type(p).__name__}, not vescale's: use "
                   f"vescale.{type(p).__name__}")
    else:
        problem = f"{p!r} (of type {type(p).__name__}) is not a placement ({_PLACEMENT_FORMS})"
    raise TypeError(f"{what}: {problem}; {expected}")


def _key_regex(key, section: str, mesh: DeviceMesh) -> re.Pattern:
    example = _param_example(_PARAM_KEY, mesh) if section == "parameter" else _forward_example(_FORWARD_KEY, mesh)
    if not isinstance(key, str):
        raise TypeError(f"{section} plan key {key!r} is of type {type(key).__name__}, not a string: keys are "
                        f"regular expressions over names, e.g. {example}")
    try:
        return re.compile(key)
    except re.error as e:
        raise ValueError(f"{section} plan key {key!r} is not a valid regular expression ({e}); e.g. {example}") \
            from None


def _checked_parameter_entry(key: str, value, mesh: DeviceMesh) -> list[Placement]:
    what = f"parameter plan key {key!r} gives {value!r}"
    expected = (f"expected a list with one placement per mesh dim ({mesh.ndim} for {mesh}), "
                f"e.g. {_param_example(key, mesh)}")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"parameter plan key {key!r} gives {_describe(value)}; {expected}")
    if any(isinstance(v, (list, tuple)) for v in value):
        raise TypeError(f"{what}, a list of lists: a parameter takes one list of placements (the nested form "
                        f"[[...]] is for 'forward' keys); {expected}")
    placements = [_checked_placement(v, what, expected) for v in value]
    if len(placements) != mesh.ndim:
        raise ValueError(f"{what}: {len(placements)} placements for a {mesh.ndim}-dim mesh; {expected}")
    return placements


def _checked_forward_entry(key: str, side: str, value, mesh: DeviceMesh):
    unit = "positional argument" if side == "input" else "output"
    expected = (f"expected one list per {unit}, each a list of one placement per mesh dim ({mesh.ndim} for "
                f"{mesh}) or None to leave that {unit} alone"
                + (", or a dict from keyword argument name to such a list" if side == "input" else "")
                + f", e.g. {_forward_example(key, mesh)}")

    def item(index, placements) -> list[Placement] | None:
        if placements is None:
            return None
        which = f"keyword argument {index!r}" if isinstance(index, str) else f"{unit} {index}"
        what = f"forward plan key {key!r}, {which}, gives {placements!r}"
        if not isinstance(placements, (list, tuple)):
            raise TypeError(f"forward plan key {key!r}, {which}, gives {_describe(placements)}; {expected}")
        if any(isinstance(p, (list, tuple)) for p in placements):
            raise TypeError(f"{what}, a list of lists: one bracket too many; {expected}")
        out = [_checked_placement(p, what, expected) for p in placements]
        if len(out) != mesh.ndim:
            raise ValueError(f"{what}: {len(out)} placements for a {mesh.ndim}-dim mesh; {expected}")
        return out

    if isinstance(value, dict):
        if side == "output":
            raise TypeError(f"forward plan key {key!r} gives a dict {value!r}, but outputs are positional; {expected}")
        for name in value:
            if not isinstance(name, str):
                raise TypeError(f"forward plan key {key!r} gives a dict keyed by {name!r}; keyword argument names "
                                f"are strings; {expected}")
        return {name: item(name, placements) for name, placements in value.items()}
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"forward plan key {key!r} gives {_describe(value)}; {expected}")
    if not value:
        raise ValueError(f"forward plan key {key!r} gives an empty list, which moves nothing; {expected}")
    if all(p is None or isinstance(p, (Placement, str)) or (isinstance(p, type) and issubclass(p, Placement))
           for p in value) and any(p is not None for p in value):
        raise TypeError(f"forward plan key {key!r} gives {value!r}, a flat list of placements: the forward form "
                        f"has two brackets, one list per {unit}; {expected}")
    return [item(i, placements) for i, placements in enumerate(value)]


def _checked_plan(plan, mesh: DeviceMesh):
    """(key, regex, placements) per parameter entry and (key, side, module pattern, its regex, spec) per
    forward entry, a spec being a list (one entry per argument or output: placements or None) or, for
    inputs, a dict by keyword argument name."""
    if not isinstance(plan, dict):
        if callable(plan) and hasattr(plan, "__name__"):
            hint = f" (call it: {plan.__name__}(...))"
        elif type(plan).__name__ == "Plan" and type(plan).__module__ == "vescale.plan":
            hint = " (a vescale.Plan holds it as plan['tensor_parallel.sharding_plan'])"
        else:
            hint = ""
        raise TypeError(f"the sharding plan must be a dict with a 'parameter' and/or a 'forward' section, got "
                        f"{_describe(plan)}{hint}; e.g. {_plan_example(mesh)}")
    unknown = [k for k in plan if k not in _SECTIONS]
    if unknown:
        close = [m for k in unknown if isinstance(k, str) for m in difflib.get_close_matches(k, _SECTIONS, 1)]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"sharding plan sections must be 'parameter' and/or 'forward', got {unknown!r}{hint}; "
                         f"e.g. {_plan_example(mesh)}")
    for section in _SECTIONS:
        if not isinstance(plan.get(section, {}), dict):
            raise TypeError(f"sharding plan section {section!r} must be a dict from pattern to placements, got "
                            f"{_describe(plan[section])}; e.g. {_plan_example(mesh)}")

    parameter_rules = [(key, _key_regex(key, "parameter", mesh), _checked_parameter_entry(key, value, mesh))
                       for key, value in plan.get("parameter", {}).items()]
    forward_rules = []
    for key, value in plan.get("forward", {}).items():
        _key_regex(key, "forward", mesh)
        # "<module pattern>.input" or "...output"; the dot may come escaped (r"mlp\.input").
        parsed = re.fullmatch(r"(.+?)\\?\.(input|output)", key)
        if parsed is None:
            last = re.fullmatch(r"(.+?)\\?\.(\w+)", key)  # a misspelt suffix ("mlp.out") or none ("mlp")
            near = difflib.get_close_matches(last.group(2), ["input", "output"], 1, 0.5) if last else []
            example = _forward_example((last.group(1) if near else key) + r"\." + (near[0] if near else "output"), mesh)
            raise ValueError(f"forward plan key {key!r} must end in '.input' or '.output' (the placements of the "
                             f"module's positional arguments, or of its results), e.g. {example}; patterns of "
                             f"parameters go in the 'parameter' section")
        pattern, side = parsed.groups()
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"forward plan key {key!r}: its module pattern {pattern!r} is not a valid regular "
                             f"expression ({e}); e.g. {_forward_example(_FORWARD_KEY, mesh)}") from None
        forward_rules.append((key, side, pattern, rx, _checked_forward_entry(key, side, value, mesh)))
    return parameter_rules, forward_rules


# ---- parameters -------------------------------------------------------------------------

def _fitted(placements: list[Placement], tensor: torch.Tensor, where: str) -> list[Placement]:
    """Placements whose Shard dims fit ``tensor``, negative dims made positive."""
    out = []
    for p in placements:
        if isinstance(p, Shard):
            if not -tensor.dim() <= p.dim < tensor.dim():
                raise ValueError(f"{where}: places a tensor of shape {tuple(tensor.shape)} as {p}, out of range for "
                                 f"its {tensor.dim()} dims; give Shard(d) with d in range({-tensor.dim()}, "
                                 f"{tensor.dim()})")
            p = Shard(p.dim % tensor.dim())
        elif isinstance(p, InterleavedShard):
            if not -tensor.dim() <= p.dim < tensor.dim():
                raise ValueError(f"{where}: places a tensor of shape {tuple(tensor.shape)} as {p}, out of range for "
                                 f"its {tensor.dim()} dims; give a dim in range({-tensor.dim()}, {tensor.dim()})")
            p = InterleavedShard(p.dim % tensor.dim(), p.groups)
        out.append(p)
    return out


def _parameter_assignments(module: nn.Module, mesh: DeviceMesh, rules) -> list[dict]:
    """Every tensor of the module (tied ones once, with all their names) with the placements
    the plan gives it, or None for replicated; changes nothing."""
    used = {key: False for key, _, _ in rules}
    entries: dict[int, dict] = {}
    for owner_name, owner in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is None:
                    continue
                fqn = f"{owner_name}.{name}" if owner_name else name
                if isinstance(tensor, DTensor):
                    raise ValueError(f"{fqn} is a DTensor already; parallelize_module expects a plain module")
                e = entries.setdefault(id(tensor), {"tensor": tensor, "refs": [], "explicit": None})
                e["refs"].append((owner, kind, name))
                hits = [(key, placements) for key, rx, placements in rules if rx.fullmatch(fqn)]
                if len(hits) > 1:
                    raise ValueError(f"{fqn} matches several parameter patterns: {[k for k, _ in hits]}; "
                                     f"make them disjoint")
                if not hits:
                    continue
                key, placements = hits[0]
                used[key] = True
                placements = _fitted(placements, tensor, f"parameter plan key {key!r} ({fqn})")
                if e["explicit"] is not None and e["explicit"][1] != placements:
                    raise ValueError(f"tied tensor named {e['explicit'][0]} and {fqn} is given different "
                                     f"placements: {e['explicit'][1]} and {placements}")
                e["explicit"] = (fqn, placements)

    unused = [key for key, hit in used.items() if not hit]
    if unused:
        names = [n for n, _ in module.named_parameters()][:6]
        example = f"; e.g. {_param_example(re.escape(names[0]), mesh)}" if names else ""
        forward_like = [k for k in unused if re.search(r"\.(input|output)$", k)]
        hint = (f" ({forward_like} look like forward keys: '.input' / '.output' keys go in the 'forward' section)"
                if forward_like else "")
        raise ValueError(f"parameter patterns {unused} match no parameter of {type(module).__name__}{hint}; "
                         f"patterns are matched against whole names such as {names}{example}")
    return list(entries.values())


def _distribute_parameters(assignments: list[dict], mesh: DeviceMesh) -> None:
    for e in assignments:
        tensor = e["tensor"]
        if is_elsewhere(tensor):  # another pipeline stage holds it
            continue
        placements = e["explicit"][1] if e["explicit"] else [Replicate()] * mesh.ndim
        if _WHAT_IF[0] and tensor.is_meta:
            dt = _meta_shard(tensor.detach(), mesh, placements)
        else:
            dt = distribute_tensor(tensor.detach(), mesh, placements)
        if isinstance(tensor, nn.Parameter):
            dt = nn.Parameter(dt, requires_grad=tensor.requires_grad)
        for owner, kind, name in e["refs"]:
            getattr(owner, kind)[name] = dt


def _meta_shard(tensor: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's shard of a meta tensor, on meta (what-if runs only)."""
    shape = list(tensor.shape)
    local, _ = _C.local_shape(shape, to_c(placements), list(mesh.shape), list(mesh.get_coordinate()))
    return DTensor.from_local(torch.empty(local, dtype=tensor.dtype, device="meta"), mesh, placements,
                              shape=shape, stride=list(tensor.stride()))


# ---- forward hooks ------------------------------------------------------------------------

def _hook_targets(module: nn.Module, mesh: DeviceMesh, rules) -> list[tuple]:
    """(module name, module, side, spec, key) per hook to install; changes nothing."""
    out = []
    for key, side, pattern, rx, spec in rules:
        targets = [(name, m) for name, m in module.named_modules() if rx.fullmatch(name)]
        if not targets:
            names = [n for n, _ in module.named_modules() if n][:6]
            example = "; e.g. " + _forward_example(re.escape(names[0]) + r"\." + side, mesh) if names else ""
            raise ValueError(f"forward plan key {key!r}: pattern {pattern!r} matches no submodule; module names look "
                             f"like {names} (the pattern is matched against whole names){example}")
        out += [(name, target, side, spec, key) for name, target in targets]
    return out


def _install_forward_hooks(hooks: list[tuple], mesh: DeviceMesh) -> None:
    for name, target, side, spec, key in hooks:
        if side == "input":
            target.register_forward_pre_hook(_input_hook(spec, mesh, f"{name}.input", key), with_kwargs=True)
        else:
            target.register_forward_hook(_output_hook(spec, mesh, f"{name}.output", key))


def _convert(value, placements, mesh: DeviceMesh, where: str, key: str):
    if placements is None or not isinstance(value, torch.Tensor) or (value.is_meta and not _WHAT_IF[0]):
        return value  # meta: a pipeline stage working out the shapes of another stage's module
    placements = _fitted(placements, value, f"forward plan key {key!r} ({where})")
    if isinstance(value, DTensor):
        # through the class: a DTensor's Python class is torch.Tensor, whose attribute
        # lookup would reach DTensor's methods only after a failed search (_tensor_methods)
        return DTensor.redistribute(value, mesh, placements)
    if on_stand_ins():
        return _stand_in_shard(value, mesh, placements)
    return DTensor.from_local(value, mesh, placements)


def _stand_in_shard(value: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """A pipeline stage's stand-in for a global value (glue computed on the zeros of
    another stage's units) as a DTensor of the same global shape: this rank's part of
    it, cut out differentiably, so that autograd still leads back to the stand-ins
    (the stage runner follows it to find values that would have to cross a cut). Taken
    as this rank's shard, as real plain tensors are, it would make a sequence-parallel
    stream as many times longer as the mesh dim is large."""
    whole_on_partial = [Replicate() if p.is_partial() else p for p in placements]
    shape = list(value.shape)
    parts = _shard_parts(shape, mesh, to_c(whole_on_partial))
    if len(parts) == 1:
        local = parts[0][1].view_of(value, whole(shape))
    else:  # an InterleavedShard: this rank's piece of each block, side by side
        sizes, _ = _C.local_shape(shape, to_c(whole_on_partial), list(mesh.shape), list(mesh.get_coordinate()))
        local = value.new_zeros(sizes)
        for shard_box, global_box in parts:
            shard_box.view_of(local, whole(sizes)).copy_(global_box.view_of(value, whole(shape)))
    return DTensor.from_local(local, mesh, placements, shape=value.shape)


def _convert_all(values: Sequence, spec: list, mesh: DeviceMesh, where: str, key: str):
    return tuple(_convert(v, spec[i] if i < len(spec) else None, mesh, f"{where}[{i}]", key)
                 for i, v in enumerate(values))


def _input_hook(spec, mesh: DeviceMesh, where: str, key: str):
    def hook(mod, args, kwargs):
        if isinstance(spec, dict):
            kwargs = {k: _convert(v, spec.get(k), mesh, f"{where}[{k}]", key) for k, v in kwargs.items()}
            return args, kwargs
        return _convert_all(args, spec, mesh, where, key), kwargs
    return hook


def _output_hook(spec: list, mesh: DeviceMesh, where: str, key: str):
    def hook(mod, args, output):
        if isinstance(output, (tuple, list)):
            return type(output)(_convert_all(output, spec, mesh, where, key))
        return _convert(output, spec[0], mesh, where, key)
    return hook
