"""``vescale.Plan``: everything about how a model is parallelised, as data.

A plan is a small tree of sections with a fixed schema (``SCHEMA``), written and read as
a dict (``to_dict`` / ``from_dict``, JSON on disk, ``state_dict`` for ``vescale.save``).
Keys may be given nested or dotted (``{"pipeline_parallel.schedule": "1f1b"}``, the form
veScale's RFC uses for constraints). ``print(plan)`` shows one ``section.key : value``
line per setting. Every check names the bad key, what was expected, and a fix.

Placements are written as in Python: ``"Shard(0)"``, ``"Replicate()"``, ``"Partial()"``.
The schema is versioned (``version``); a plan from a newer version is refused.

Why not protobuf: the schema is a handful of scalars, lists and the sharding plan's
regex -> placements maps; the C++ planner hands plans to Python through the extension as
dicts, and JSON gives the readable text form. A second code generator in the build and
the wheel would not earn its place.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

import torch.nn as nn

from .parallel.pipeline.engine import SPLIT_METHODS
from .parallel.pipeline.schedules import SCHEDULES, make_schedule
from .placement_types import InterleavedShard, Partial, Placement, Replicate, Shard

VERSION = 1

# section -> key -> (default, check). A check returns None when the value is fine, else
# what was expected.


def _is(types, what: str):
    return lambda v: None if isinstance(v, types) else what


def _int_at_least(low: int):
    return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= low else f"an integer >= {low}"


def _one_of(options):
    return lambda v: None if v in options else f"one of {list(options)}"


def _optional(check):
    return lambda v: None if v is None else check(v)


def _str_list(v):
    ok = isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
    return None if ok else "a list of module names"


SCHEMA: dict[str, dict[str, tuple[Any, Any]]] = {
    "mesh": {},  # dim name -> size, outermost first; checked by _check_mesh
    "tensor_parallel": {
        "sharding_plan": ({}, lambda v: None if isinstance(v, dict) else "a dict {'parameter': {...}, 'forward': {...}}"),
        "sequence_parallel": (False, _is((bool,), "True or False")),
        "dim": ("TP", _is((str,), "a mesh dim name")),
    },
    "data_parallel": {
        "zero_stage": (0, _one_of((0, 1, 2, 3))),
        "bucket_cap_mb": (25.0, lambda v: None if isinstance(v, (int, float)) and v > 0 else "a positive number"),
        "dim": ("DP", _is((str,), "a mesh dim name")),
    },
    "pipeline_parallel": {
        "split_points": (None, _optional(_str_list)),
        "split_method": ("uniform", _one_of(SPLIT_METHODS)),
        "schedule": ("1f1b", _one_of(SCHEDULES)),
        "microbatches": (1, _int_at_least(1)),
        "virtual_stages": (1, _int_at_least(1)),
        "blocks": (None, _optional(_is((str,), "the name of the model's list of blocks, e.g. 'model.layers'"))),
        "dim": ("PP", _is((str,), "a mesh dim name")),
    },
    "mixed_precision": {
        "param_dtype": (None, _optional(_one_of(("bfloat16", "float16", "float32")))),
        "loss_scale": (None, lambda v: None if v is None or v == "dynamic" or (isinstance(v, (int, float)) and v > 0)
                       else "None, 'dynamic' or a positive number"),
    },
    "gradient": {
        "clip_norm": (None, lambda v: None if v is None or (isinstance(v, (int, float)) and v > 0)
                      else "None or a positive number"),
        "accumulation_steps": (1, _int_at_least(1)),
    },
    "recompute": {
        "modules": ([], _str_list),
    },
    "data": {  # the data loader vescale.parallelize makes from a dataset
        "global_batch_size": (None, _optional(_int_at_least(1))),
        "shuffle": (True, _is((bool,), "True or False")),
        "seed": (0, _is((int,), "an integer")),
        "drop_last": (True, _is((bool,), "True or False")),
    },
}


class PlanError(ValueError):
    """A plan entry is malformed or does not fit the model or the world."""


class Plan:
    """How to parallelise a model: mesh, tensor / data / pipeline parallelism, mixed
    precision, gradient clipping and accumulation, recomputation.

    ``Plan({"mesh": {"DP": 2, "TP": 2}, "tensor_parallel.sharding_plan": llama_plan()})``;
    anything left out takes its default (``SCHEMA``).
    """

    def __init__(self, settings: dict | None = None, **sections):
        self._values = {section: {k: _copy(d) for k, (d, _) in keys.items()} for section, keys in SCHEMA.items()}
        self._values["mesh"] = {}
        self.update(settings or {})
        self.update(sections)

    # ---- reading and writing ----

    def update(self, settings: dict) -> "Plan":
        for key, value in _flatten(settings).items():
            section, _, name = key.partition(".")
            if section == "version":
                _check_version(value)
                continue
            if section not in SCHEMA:
                raise PlanError(_unknown(key, list(SCHEMA) + ["version"], "section"))
            if section == "mesh":
                if name:
                    self._values["mesh"][name] = value
                else:
                    _check_mesh(value)
                    self._values["mesh"] = dict(value)
                _check_mesh(self._values["mesh"])
                continue
            if not name:
                raise PlanError(f"plan section {section!r} takes a dict of settings, e.g. "
                                f"{{{section!r}: {{{next(iter(SCHEMA[section]))!r}: ...}}}}")
            if name not in SCHEMA[section]:
                raise PlanError(_unknown(key, [f"{section}.{k}" for k in SCHEMA[section]], "key"))
            problem = SCHEMA[section][name][1](value)
            if problem:
                raise PlanError(f"plan key {key!r} is {value!r}; expected {problem}")
            if key == "tensor_parallel.sharding_plan":
                value = _parse_sharding_plan(value)
            self._values[section][name] = _copy(value)
        return self

    def __getitem__(self, key: str):
        section, _, name = key.partition(".")
        if section not in self._values or (name and name not in self._values[section]):
            raise KeyError(_unknown(key, list(_flatten(self.to_dict())), "key"))
        return self._values[section][name] if name else self._values[section]

    def __getattr__(self, section: str):
        if section.startswith("_") or section not in SCHEMA:
            raise AttributeError(section)
        return _Section(self._values[section])

    def to_dict(self) -> dict:
        """The plan as plain data (placements written as strings), with its version."""
        out = {"version": VERSION}
        for section, values in self._values.items():
            out[section] = _copy(values)
        tp = out["tensor_parallel"]
        tp["sharding_plan"] = _write_sharding_plan(tp["sharding_plan"])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        return cls(data)

    @classmethod
    def from_hf(cls, model, *, mesh: dict, sequence_parallel: bool = False, **sections) -> "Plan":
        """A plan for a Hugging Face model from its own parallel plans, no regexes by hand:
        the tensor-parallel placements from ``config.base_model_tp_plan`` (and the LM head's
        ``_tp_plan``; styles mapped as ``vescale.parallel.plans.hf_plan`` documents), and the
        pipeline's block list from ``config.base_model_pp_plan`` (the entry that holds the
        layers). ``mesh`` as in the plan (e.g. ``{"DP": 2, "TP": 2}``); other sections may
        be given as keyword arguments with dotted or nested keys, e.g.
        ``Plan.from_hf(model, mesh={"PP": 2}, **{"pipeline_parallel.microbatches": 4})``."""
        from .parallel.plans import hf_plan

        plan = cls({"mesh": mesh})
        plan.update({"tensor_parallel.sequence_parallel": sequence_parallel})
        tp_dim = plan["tensor_parallel.dim"]
        if mesh.get(tp_dim, 1) > 1 or sequence_parallel:
            plan.update({"tensor_parallel.sharding_plan": hf_plan(model, sequence_parallel=sequence_parallel)})
        blocks = _hf_blocks(model)
        if blocks is not None:
            plan.update({"pipeline_parallel.blocks": blocks})
        plan.update(sections)
        return plan

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # vescale.save / vescale.load keep a plan through these
    def state_dict(self) -> dict:
        return self.to_dict()

    def load_state_dict(self, data: dict) -> None:
        fresh = Plan.from_dict(data)
        self._values = fresh._values

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        lines = []
        for key, value in _flatten(self.to_dict()).items():
            if key == "version":
                continue
            if key == "tensor_parallel.sharding_plan":
                for kind, patterns in value.items():
                    for pattern, placements in patterns.items():
                        lines.append(f"tensor_parallel.sharding_plan.{kind} : {pattern} -> "
                                     f"{json.dumps(placements)}")
                continue
            lines.append(f"{key} : {json.dumps(value)}")
        report = getattr(self, "_report", None)  # vescale.generate_plan's prediction, runners-up and why
        if report is not None:
            lines += ["# " + line for line in str(report).splitlines()]
        return "\n".join(lines)

    # ---- checks against the world and the model ----

    @property
    def world_size(self) -> int:
        return math.prod(self._values["mesh"].values()) if self._values["mesh"] else 1

    def validate(self, *, world_size: int | None = None, model=None) -> "Plan":
        """Checks that the mesh covers ``world_size`` ranks and that the plan fits
        ``model`` (split points are blocks, patterns match parameters, placements fit
        their shapes); returns the plan."""
        mesh = self._values["mesh"]
        if world_size is not None and self.world_size != world_size:
            raise PlanError(f"plan mesh {mesh} holds {self.world_size} ranks but the world has {world_size}; "
                            f"make the sizes multiply to {world_size}")
        for section in ("tensor_parallel", "data_parallel", "pipeline_parallel"):
            dim = self._values[section]["dim"]
            used = _section_used(self, section)
            if used and dim not in mesh:
                raise PlanError(f"plan key {section}.dim is {dim!r}, which is not a dim of the mesh {mesh}; add it "
                                f"to 'mesh' or name one of {list(mesh)}")
        pp = self._values["pipeline_parallel"]
        pp_size = mesh.get(pp["dim"], 1)
        if pp_size > 1:
            try:
                make_schedule(pp["schedule"], pp_size, pp["microbatches"], pp["virtual_stages"])
            except ValueError as e:
                raise PlanError(f"plan keys pipeline_parallel.*: {e}") from None
        if pp["split_points"] is not None and len(pp["split_points"]) != self.stages - 1:
            raise PlanError(f"plan key pipeline_parallel.split_points names {len(pp['split_points'])} split points "
                            f"for {self.stages} stages; give {self.stages - 1}")
        if model is not None:
            self._validate_model(model)
        return self

    @property
    def stages(self) -> int:
        pp = self._values["pipeline_parallel"]
        return self._values["mesh"].get(pp["dim"], 1) * (2 if pp["schedule"] == "zbv" else pp["virtual_stages"])

    def _validate_model(self, model) -> None:
        names = {n for n, _ in model.named_modules()}
        for point in self._values["pipeline_parallel"]["split_points"] or []:
            if point not in names:
                close = difflib.get_close_matches(point, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise PlanError(f"plan key pipeline_parallel.split_points names {point!r}, which is not a module of "
                                f"{type(model).__name__}{hint}")
        params = dict(model.named_parameters(remove_duplicate=False))
        tp_size = self._values["mesh"].get(self._values["tensor_parallel"]["dim"], 1)
        for pattern, placements in self._values["tensor_parallel"]["sharding_plan"].get("parameter", {}).items():
            hits = [n for n in params if re.fullmatch(pattern, n)]
            if not hits:
                raise PlanError(f"plan key tensor_parallel.sharding_plan.parameter[{pattern!r}] matches no parameter "
                                f"of {type(model).__name__}; patterns match whole names such as "
                                f"{list(params)[:3]}")
            for name in hits:
                shape = tuple(params[name].shape)
                for p in placements:
                    if p.splits() and not -len(shape) <= p.dim < len(shape):
                        raise PlanError(f"plan key tensor_parallel.sharding_plan.parameter[{pattern!r}] places {name} "
                                        f"(shape {shape}) as {p}, out of range for its {len(shape)} dims")
                    if p.is_interleaved() and shape[p.dim] % (p.groups * tp_size):
                        raise PlanError(f"plan key tensor_parallel.sharding_plan.parameter[{pattern!r}] places {name} "
                                        f"(shape {shape}) as {p}: dim {p.dim} does not divide into {p.groups} blocks "
                                        f"of {tp_size} equal pieces")
                    if isinstance(p, Shard) and shape[p.dim] < tp_size:
                        raise PlanError(f"plan key tensor_parallel.sharding_plan.parameter[{pattern!r}] shards {name} "
                                        f"dim {p.dim} of size {shape[p.dim]} over {tp_size} ranks; some would hold "
                                        f"nothing: replicate it or use a smaller TP degree")


class _Section:
    """Attribute access to one section: ``plan.pipeline_parallel.schedule``."""

    def __init__(self, values: dict):
        object.__setattr__(self, "_v", values)

    def __getattr__(self, name: str):
        try:
            return self._v[name]
        except KeyError:
            raise AttributeError(_unknown(name, list(self._v), "key")) from None

    def __setattr__(self, name, value):
        raise AttributeError("plans are changed through Plan.update({'section.key': value}), which checks the value")

    def __repr__(self) -> str:
        return repr(self._v)


# ---- helpers ----

def _copy(value):
    """A copy of plain data, tuples as lists (as they come back from JSON); placements,
    immutable, are shared."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _flatten(settings: dict, prefix: str = "") -> dict:
    """Nested sections to dotted keys, down to a section's keys (values stay whole)."""
    out = {}
    for key, value in settings.items():
        if not isinstance(key, str):
            raise PlanError(f"plan keys are strings, got {key!r}")
        full = f"{prefix}{key}"
        if not prefix and "." not in key and key in SCHEMA and key != "mesh" and isinstance(value, dict):
            out.update(_flatten(value, f"{key}."))
        else:
            out[full] = value
    return out


def _unknown(key: str, valid: list[str], what: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown plan {what} {key!r}; {hint}valid: {sorted(valid)}"


def _check_version(value) -> None:
    if not isinstance(value, int) or value > VERSION or value < 1:
        raise PlanError(f"plan version {value!r} is not one this vescale reads (1..{VERSION}); a newer vescale "
                        f"wrote it, or it is not a plan")


def _check_mesh(mesh: dict) -> None:
    if not isinstance(mesh, dict):
        raise PlanError(f"plan key 'mesh' is {mesh!r}; expected a dict of dim name -> size, e.g. "
                        f"{{'DP': 2, 'TP': 2}}")
    for name, size in mesh.items():
        if not isinstance(name, str) or not name:
            raise PlanError(f"plan mesh dim name {name!r} must be a non-empty string such as 'DP'")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise PlanError(f"plan key mesh.{name} is {size!r}; expected a positive integer (the dim's size)")


def _hf_blocks(model) -> str | None:
    """The FQN of a Hugging Face model's block list from ``config.base_model_pp_plan``
    (its keys are modules of the base model; the layers are the one that is a ModuleList)."""
    pp_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    for key in pp_plan:
        try:
            module = model.get_submodule(prefix + key)
        except AttributeError:
            continue
        if isinstance(module, nn.ModuleList):
            return prefix + key
    return None


def _section_used(plan: Plan, section: str) -> bool:
    v = plan._values[section]
    if section == "tensor_parallel":
        return bool(v["sharding_plan"]) or v["sequence_parallel"]
    if section == "data_parallel":
        return v["zero_stage"] > 0
    return v["split_points"] is not None


_PLACEMENT = re.compile(r"^\s*(Shard)\(\s*(?:dim\s*=\s*)?(-?\d+)\s*\)\s*$|^\s*(Replicate)\(\s*\)\s*$"
                        r"|^\s*(Partial)\(\s*(\w*)\s*\)\s*$")
_INTERLEAVED = re.compile(r"^\s*InterleavedShard\(\s*(?:dim\s*=\s*)?(-?\d+)\s*,\s*(?:groups\s*=\s*)?(\d+)\s*\)\s*$")


def parse_placement(text, where: str) -> Placement:
    if isinstance(text, Placement):
        return text
    if isinstance(text, str) and (m := _INTERLEAVED.match(text)):
        return InterleavedShard(int(m.group(1)), int(m.group(2)))
    m = _PLACEMENT.match(text) if isinstance(text, str) else None
    if not m:
        raise PlanError(f"{where}: {text!r} is not a placement; write 'Shard(0)', 'Replicate()', 'Partial()' "
                        f"or 'InterleavedShard(0, 3)'")
    if m.group(1):
        return Shard(int(m.group(2)))
    if m.group(3):
        return Replicate()
    return Partial(m.group(5) or "sum")


def _parse_sharding_plan(plan: dict) -> dict:
    out = {}
    for kind, patterns in plan.items():
        where = f"tensor_parallel.sharding_plan.{kind}"
        if kind not in ("parameter", "forward"):
            raise PlanError(_unknown(where, ["tensor_parallel.sharding_plan.parameter",
                                             "tensor_parallel.sharding_plan.forward"], "key"))
        if not isinstance(patterns, dict):
            raise PlanError(f"plan key {where} must map regular expressions to placements, e.g. "
                            f"{{r'.*q_proj\\.weight': ['Shard(0)']}}")
        out[kind] = {}
        for pattern, placements in patterns.items():
            key = f"{where}[{pattern!r}]"
            try:
                re.compile(pattern)
            except re.error as e:
                raise PlanError(f"plan key {key}: not a valid regular expression ({e})") from None
            if kind == "parameter":
                if isinstance(placements, (Placement, str)) or not isinstance(placements, (list, tuple)):
                    raise PlanError(f"plan key {key} is {placements!r}; expected a list with one placement per "
                                    f"mesh dim, e.g. ['Shard(0)']")
                out[kind][pattern] = [parse_placement(p, key) for p in placements]
            elif isinstance(placements, dict) and where.endswith("forward") and pattern.endswith("input"):
                # keyword arguments by name: {"hidden_states": ["Replicate()"]}
                out[kind][pattern] = {}
                for name, ps in placements.items():
                    if not isinstance(name, str) or isinstance(ps, (Placement, str)) or not isinstance(ps, (list, tuple)):
                        raise PlanError(f"plan key {key} is {placements!r}; keyword arguments map a name to a list "
                                        f"of placements, e.g. {{'hidden_states': ['Replicate()']}}")
                    out[kind][pattern][name] = [parse_placement(p, key) for p in ps]
            else:  # forward: one list per argument (None leaves an argument alone), one placement per mesh dim
                if not isinstance(placements, (list, tuple)) or any(
                        a is not None and (isinstance(a, (Placement, str)) or not isinstance(a, (list, tuple)))
                        for a in placements):
                    raise PlanError(f"plan key {key} is {placements!r}; expected a list per argument, each a list "
                                    f"of placements, e.g. [['Replicate()']] (note the two brackets)")
                out[kind][pattern] = [None if a is None else [parse_placement(p, key) for p in a] for a in placements]
    return out


def placement_text(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, InterleavedShard):
        return f"InterleavedShard({p.dim}, {p.groups})"
    if isinstance(p, Partial):
        return "Partial()" if p.reduce_op == "sum" else f"Partial({p.reduce_op})"
    return "Replicate()"


def _write_sharding_plan(plan: dict) -> dict:
    def write(p):
        return placement_text(p) if isinstance(p, Placement) else p
    out = {}
    for kind, patterns in plan.items():
        if kind == "parameter":
            out[kind] = {k: [write(p) for p in v] for k, v in patterns.items()}
        else:
            out[kind] = {k: ({n: [write(p) for p in a] for n, a in v.items()} if isinstance(v, dict) else
                             [None if a is None else [write(p) for p in a] for a in v]) for k, v in patterns.items()}
    return out
