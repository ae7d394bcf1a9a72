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
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.nn as nn

from ..device_mesh import DeviceMesh
from ..dtensor import DTensor, distribute_tensor
from ..placement_types import InterleavedShard, Placement, Replicate, Shard
from .pipeline.stage import is_elsewhere

__all__ = ["parallelize_module"]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, sharding_plan: dict) -> nn.Module:
    """Shards ``module`` in place on ``device_mesh`` following ``sharding_plan``; returns it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_module expects an nn.Module, got {type(module).__name__}")
    unknown = set(sharding_plan) - {"parameter", "forward"}
    if unknown:
        raise ValueError(f"sharding plan sections must be 'parameter' and/or 'forward', got {sorted(unknown)}")
    _distribute_parameters(module, device_mesh, sharding_plan.get("parameter", {}))
    _install_forward_hooks(module, device_mesh, sharding_plan.get("forward", {}))
    return module


# ---- parameters -------------------------------------------------------------------------

def _compile(patterns: dict, what: str) -> list[tuple[str, re.Pattern, Any]]:
    out = []
    for pattern, value in patterns.items():
        try:
            out.append((pattern, re.compile(pattern), value))
        except re.error as e:
            raise ValueError(f"{what} pattern {pattern!r} is not a valid regular expression: {e}") from None
    return out


def _checked_placements(placements, mesh: DeviceMesh, tensor: torch.Tensor, fqn: str) -> list[Placement]:
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"plan gives {fqn} {len(placements)} placements {placements} but the mesh {mesh} has "
                         f"{mesh.ndim} dims; give one placement per mesh dim")
    out = []
    for p in placements:
        if isinstance(p, Shard):
            if not -tensor.dim() <= p.dim < tensor.dim():
                raise ValueError(f"plan places {fqn} (shape {tuple(tensor.shape)}) as {p}, out of range for its "
                                 f"{tensor.dim()} dims")
            p = Shard(p.dim % tensor.dim())
        elif isinstance(p, InterleavedShard):
            if not -tensor.dim() <= p.dim < tensor.dim():
                raise ValueError(f"plan places {fqn} (shape {tuple(tensor.shape)}) as {p}, out of range for its "
                                 f"{tensor.dim()} dims")
            p = InterleavedShard(p.dim % tensor.dim(), p.groups)
        elif not isinstance(p, Placement):
            raise TypeError(f"plan entry for {fqn} holds {p!r}, not a placement (Shard(d), Replicate(), Partial())")
        out.append(p)
    return out


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, plan: dict) -> None:
    rules = _compile(plan, "parameter")
    used = {pattern: False for pattern, _, _ in rules}

    def explicit_placements(fqn: str, tensor: torch.Tensor):
        hits = [(pattern, value) for pattern, rx, value in rules if rx.fullmatch(fqn)]
        if len(hits) > 1:
            raise ValueError(f"{fqn} matches several parameter patterns: {[p for p, _ in hits]}")
        if not hits:
            return None
        used[hits[0][0]] = True
        return _checked_placements(hits[0][1], mesh, tensor, fqn)

    # Every name of every tensor (tied weights have several) with what the plan says.
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
                placements = explicit_placements(fqn, tensor)
                if placements is None:
                    continue
                if e["explicit"] is not None and e["explicit"][1] != placements:
                    raise ValueError(f"tied tensor named {e['explicit'][0]} and {fqn} is given different "
                                     f"placements: {e['explicit'][1]} and {placements}")
                e["explicit"] = (fqn, placements)

    for e in entries.values():
        tensor = e["tensor"]
        if is_elsewhere(tensor):  # another pipeline stage holds it
            continue
        placements = e["explicit"][1] if e["explicit"] else [Replicate()] * mesh.ndim
        dt = distribute_tensor(tensor.detach(), mesh, placements)
        if isinstance(tensor, nn.Parameter):
            dt = nn.Parameter(dt, requires_grad=tensor.requires_grad)
        for owner, kind, name in e["refs"]:
            getattr(owner, kind)[name] = dt

    unused = [p for p, hit in used.items() if not hit]
    if unused:
        names = [n for n, _ in module.named_parameters()][:6]
        raise ValueError(f"parameter patterns {unused} match no parameter of {type(module).__name__}; "
                         f"patterns are matched against whole names such as {names}")


# ---- forward hooks ------------------------------------------------------------------------

def _convert(value, placements, mesh: DeviceMesh, where: str):
    if placements is None or not isinstance(value, torch.Tensor) or value.is_meta:
        return value  # meta: a pipeline stage working out the shapes of another stage's module
    placements = _checked_placements(placements, mesh, value, where)
    if isinstance(value, DTensor):
        return value.redistribute(mesh, placements)
    return DTensor.from_local(value, mesh, placements)


def _convert_all(values: Sequence, spec, mesh: DeviceMesh, where: str):
    if isinstance(spec, dict):
        raise TypeError(f"{where}: give positional placements as a list (one entry per argument)")
    spec = list(spec)
    return tuple(_convert(v, spec[i] if i < len(spec) else None, mesh, f"{where}[{i}]") for i, v in enumerate(values))


def _install_forward_hooks(module: nn.Module, mesh: DeviceMesh, plan: dict) -> None:
    for key, spec in plan.items():
        # "<module pattern>.input" or "...output"; the dot may come escaped (r"mlp\.input").
        parsed = re.fullmatch(r"(.+?)\\?\.(input|output)", key)
        if parsed is None:
            raise ValueError(f"forward plan key {key!r} must end in '.input' or '.output'")
        pattern, side = parsed.groups()
        rx = re.compile(pattern)
        targets = [(name, m) for name, m in module.named_modules() if rx.fullmatch(name)]
        if not targets:
            names = [n for n, _ in module.named_modules() if n][:6]
            raise ValueError(f"forward plan key {key!r}: pattern {pattern!r} matches no submodule; "
                             f"module names look like {names}")
        for name, target in targets:
            if side == "input":
                target.register_forward_pre_hook(_input_hook(spec, mesh, f"{name}.input"), with_kwargs=True)
            else:
                target.register_forward_hook(_output_hook(spec, mesh, f"{name}.output"))


def _input_hook(spec, mesh: DeviceMesh, where: str):
    def hook(mod, args, kwargs):
        if isinstance(spec, dict):
            kwargs = {k: _convert(v, spec.get(k), mesh, f"{where}[{k}]") for k, v in kwargs.items()}
            return args, kwargs
        return _convert_all(args, spec, mesh, where), kwargs
    return hook


def _output_hook(spec, mesh: DeviceMesh, where: str):
    def hook(mod, args, output):
        if isinstance(output, (tuple, list)):
            return type(output)(_convert_all(output, spec, mesh, where))
        return _convert(output, list(spec)[0], mesh, where)
    return hook
