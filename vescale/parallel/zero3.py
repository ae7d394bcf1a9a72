"""ZeRO-3: parameters live as this rank's DP slice and are whole only while a module
that owns them runs.

Parameters are gathered by unit, as in torch's FSDP recipe: every member of an
``nn.ModuleList`` (a transformer block) is a unit, and each model's root is the unit
of the parameters no block owns (embeddings, final norm, output projection). A unit
costs one all-gather per dtype before its forward and one before its backward.

Each parameter's local tensor (a DTensor's shard or a plain tensor) keeps its
storage object, emptied between uses: just before a module's forward, and again
before its backward, the slices are all-gathered back into that storage; after the
forward, and once backward has produced every gradient of the module's parameters,
the storage is emptied again. Autograd's saved references see the data again because
the storage object is the same, and the writes go to the storage directly, so no
version counter moves (which autograd would report as an in-place modification).

Every rank must issue the same all-gathers in the same order. Which parameters get a
gradient can differ between ranks (a data-dependent branch), so the early emptying
after the last gradient is a memory saving only: whether an all-gather is needed is
decided from a record of what is whole (``_whole``) that changes only at events every
rank sees alike (a unit's forward starts and ends, a backward gathers a unit and ends,
``whole``/``held`` open and close, the optimizer steps). At the end of each backward,
as torch's FSDP does, every unit gathered for it is released, on every rank.

The gradients' reduce-scatters (DDP's) share the DP group, so they too are launched at
such events: when backward reaches a unit, before its gather, ZeRO-3 tells the DDPs
(``_agreed_point``), which launch the buckets of the unit reached before it; that unit's
backward has ended on every rank once every use of it in forward has begun its backward
and its forward encloses no other unit's (``_unit_backward_started``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _trace
from ..deferred import is_deferred, swap_keeping_hooks
from .._local import local_of
from .ddp import Slot
from . import released

__all__ = ["ShardedParameters", "all_gather_slices", "fill_rows"]

@dataclass
class _Sharded:
    param: nn.Parameter
    slot: Slot
    start: int
    end: int
    slice: torch.Tensor  # this rank's elements, in the parameter's dtype


class ShardedParameters:
    def __init__(self, modules: list[nn.Module], slots: list[tuple[Slot, int, int, torch.Tensor]], group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.sharded: dict[int, _Sharded] = {}
        self._pinned = collections.Counter()  # ids of entries that release() leaves whole (held)
        # ids of entries whole by agreement (see the module's docstring): gather and release
        # decide by it, never by this rank's storage, which a rank whose parameter got no
        # gradient empties later than the others
        self._whole: set[int] = set()
        for slot, start, end, values in slots:  # `values`: this rank's slice, owned from now on
            if is_deferred(slot.param):  # a storage to gather into, never touched until then
                storage = torch.empty(slot.param.shape, dtype=values.dtype, device=values.device)
                swap_keeping_hooks(slot.param, nn.Parameter(storage, requires_grad=slot.param.requires_grad))
            self.sharded[id(slot.param)] = _Sharded(slot.param, slot, start, end, values)
        claimed: set[int] = set()
        self._root_owned: set[int] = set()
        for root in modules:
            for n, p in root.named_parameters():
                released.name(p, n)
            units = _units(root)
            for unit in units:
                owned = [p for p in unit.parameters() if id(p) in self.sharded and id(p) not in claimed]
                claimed.update(id(p) for p in owned)
                if unit is units[-1]:
                    self._root_owned.update(id(p) for p in owned)
                if owned:
                    self._hook(unit, owned)
        self.release(list(self.sharded.values()))
        # Backward prefetch (as FSDP2 does): when a unit is gathered for its backward, the
        # gather of the unit whose forward finished just before its own starts too,
        # overlapping this unit's backward. What is left when backward ends is dropped
        # (the optimizer then changes the slices).
        self._forward_order: list[list[_Sharded]] = []
        self._prefetched: dict[int, list] = {}  # id(unit entries) -> start_gather_slices' result
        self._backward_units: dict[int, list[_Sharded]] = {}  # units gathered for the running backward
        self._backward_queued = False
        self._keep_gathered = False  # kept_gathered(): a backward's end releases nothing
        self._forward_restarts = True
        # for the DDPs' reduce-scatters (they register as listeners): per unit (id of its
        # entries), its forwards since the last backward and its backward uses begun; the
        # units whose forward ran another unit's (a root); the forwards running now
        self._listeners: list = []
        self._forward_counts: dict[int, int] = {}
        self._backward_counts: dict[int, int] = {}
        self._enclosing: set[int] = set()
        self._open: list[list[_Sharded]] = []
        self.prefetch_hits = 0  # gathers served by a prefetch (for tests and benchmarks)

    def slice_of(self, param: nn.Parameter) -> torch.Tensor:
        return self.sharded[id(param)].slice

    @contextlib.contextmanager
    def whole(self):
        """Every parameter whole for the duration (to read, edit, save or evaluate them:
        a forward inside releases nothing); outside forward and backward their storage is
        empty and must not be read. What is written into them meanwhile is kept: each
        rank copies its slice back (as on one device, where an edit between steps stays),
        unless the slice itself changed meanwhile (a step or a checkpoint load: the slice
        is newer)."""
        entries = list(self.sharded.values())
        versions = {id(e): e.slice._version for e in entries}
        with self.held_entries(entries):
            try:
                yield
            finally:
                self._keep_writes([e for e in entries if e.slice._version == versions[id(e)]])

    @torch.no_grad()
    def _keep_writes(self, entries: list[_Sharded]) -> None:
        for e in entries:
            if id(e) in self._whole:  # (a step inside the context released it)
                e.slice.copy_(_alias(local_of(e.param))[e.start:e.end])

    @contextlib.contextmanager
    def whole_for(self, params: list[nn.Parameter]):
        """The given parameters (those sharded here) whole for the duration, then emptied.
        For backward work that no module hook announces: a zero-bubble schedule's
        weight-gradient pass reads the parameters its graph saved, after later forwards
        of the unit have emptied them again."""
        entries = [self.sharded[id(p)] for p in params if id(p) in self.sharded]
        self.gather(entries)
        try:
            yield
        finally:
            self.release(entries)

    def held(self, params: list[nn.Parameter]):
        """The given parameters (those sharded here) whole for the duration, whatever
        releases them meanwhile (their units' own hooks, ``whole_for``), then emptied."""
        return self.held_entries([self.sharded[id(p)] for p in params if id(p) in self.sharded])

    @contextlib.contextmanager
    def held_entries(self, entries: list[_Sharded]):
        self.gather(entries)
        pins = collections.Counter(id(e) for e in entries)
        self._pinned += pins  # (counted: a pipeline's `held` may run inside `whole`)
        try:
            yield
        finally:
            self._pinned -= pins
            self.release(entries)

    @contextlib.contextmanager
    def kept_gathered(self):
        """Backward passes run meanwhile leave the units they gathered whole: a split
        backward's input half, whose weight half (``whole_for``) reads them next. That
        half accumulates no gradient, so no rank has emptied any of them early."""
        self._keep_gathered = True
        try:
            yield
        finally:
            self._keep_gathered = False
            if self._backward_queued:  # it raised before its end (the pipeline then runs a whole backward)
                self._backward_ended()

    def restart_forward_order(self) -> None:
        """The next forward starts a new forward order. A pipeline calls this before each
        forward action, so that backward prefetches a unit that ran before in the same
        action (the same stage), never one of another stage, which that backward does
        not visit (its gather was dropped)."""
        self._forward_restarts = True

    def owned_by_root(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Those of ``params`` that belong to a model's root unit (embeddings, final norm,
        head). A pipeline stage runs only part of the root, so the root's hooks do not
        announce its work: the pipeline holds these whole for its whole step."""
        return [p for p in params if id(p) in self._root_owned]

    # ---- gather and release ----

    def gather(self, entries: list[_Sharded]) -> None:
        """One all-gather per dtype for all of `entries` that are not whole yet (waiting
        for the one prefetched for them, if any)."""
        started = self._prefetched.pop(id(entries), None)
        if started is None:
            missing = [e for e in entries if id(e) not in self._whole]
            started = start_gather_slices(missing, [e.slice for e in missing], self.group)
        else:
            self.prefetch_hits += 1
        for e, rows in finish_gather_slices(started):
            if id(e) in self._whole:  # whole already (a prefetch covers the whole unit)
                continue
            released.unguard(e.param)
            local = local_of(e.param)
            local.untyped_storage().resize_((local.storage_offset() + local.numel()) * local.element_size())
            fill_rows(_alias(local), rows)
            self._whole.add(id(e))

    def _prefetch_before(self, entries: list[_Sharded]) -> None:
        """Starts gathering the unit whose forward finished just before ``entries``' one."""
        order = self._forward_order
        at = next((i for i, u in enumerate(order) if u is entries), None)
        if not at:
            return
        previous = order[at - 1]
        if id(previous) not in self._prefetched and not any(id(e) in self._whole for e in previous):
            self._prefetched[id(previous)] = start_gather_slices(previous, [e.slice for e in previous], self.group)

    def _backward_started(self, entries: list[_Sharded]) -> None:
        """Notes ``entries`` as gathered for the running backward, whose end the first
        unit queues (in the outermost graph task: a reentrant checkpoint's own backward
        runs inside it and ends first)."""
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self._backward_units[id(entries)] = entries

    def _backward_ended(self) -> None:
        for started in self._prefetched.values():
            _wait(started)  # (then dropped)
        self._prefetched.clear()
        # Every unit this backward gathered, released on every rank alike (as FSDP reshards
        # at the end of backward): a rank where one of a unit's parameters got no gradient
        # (a data-dependent branch) never saw the unit's last gradient, and would keep it
        # whole and skip the next all-gather of it that the other ranks issue.
        if not self._keep_gathered:
            for entries in self._backward_units.values():
                self.release(entries)
        self._backward_units.clear()
        self._backward_counts.clear()
        self._open = []
        self._backward_queued = False
        self._forward_restarts = True

    def release(self, entries: list[_Sharded]) -> None:
        for e in entries:
            if id(e) not in self._pinned:
                self._whole.discard(id(e))
                _free(e)

    # ---- module hooks ----

    def _hook(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        entries = [self.sharded[id(p)] for p in params]
        waiting = {"count": 0}
        shadow = {"now": False}
        table, name = _home_of(module, params[0])

        def before_forward(mod, args):
            # a pipeline stage runs an earlier stage's unit as a shadow, on meta twins of
            # its parameters (vescale/parallel/pipeline/stage.py): nothing to gather, and
            # it is not a forward that backward will visit
            shadow["now"] = table[name] is not params[0]
            if self._backward_queued and torch._C._current_graph_task_id() == -1:
                self._backward_ended()  # the last backward raised: its end never ran
            if not shadow["now"]:
                for running in self._open:  # its forward runs this one's
                    self._enclosing.add(id(running))
                self._open.append(entries)
                self.gather(entries)

        def before_backward(*grads):
            self._backward_started(entries)
            # every rank reaches this point in the same order: the DDPs' reduce-scatters due
            # here are issued before this unit's gather and the next one's prefetch
            for listener in self._listeners:
                listener._agreed_point()
            key = id(entries)
            self._backward_counts[key] = self._backward_counts.get(key, 0) + 1
            if key not in self._enclosing and self._backward_counts[key] >= self._forward_counts.get(key, 0) > 0:
                for listener in self._listeners:  # its backward ends before the next unit's begins
                    listener._unit_backward_started(module)
            waiting["count"] = len(entries)
            self.gather(entries)
            self._prefetch_before(entries)

        def after_forward(mod, args, output):
            if shadow["now"]:
                return
            for i in range(len(self._open) - 1, -1, -1):
                if self._open[i] is entries:
                    del self._open[i]
                    break
            self.release(entries)
            if self._forward_restarts:  # the first forward since a backward: a new order
                self._forward_order, self._forward_restarts = [], False
                self._forward_counts = {}
            self._forward_order.append(entries)  # (backward visits the units in reverse)
            # gathered again when the first gradient of any output arrives (a module
            # backward pre-hook would miss outputs that are not tensors or tuples of
            # them, such as Hugging Face's ModelOutput)
            outs = [t for t in _tensors_in(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, before_backward, mode="any")
                if torch._C._current_graph_task_id() == -1:  # (not a recomputation in backward)
                    self._forward_counts[id(entries)] = self._forward_counts.get(id(entries), 0) + 1

        def grad_ready(param):
            waiting["count"] -= 1
            if waiting["count"] == 0:
                # this rank's copies are not needed any more: emptied now, to save memory;
                # the record of what is whole changes when backward ends (_backward_ended),
                # on the ranks where some parameter of the unit got no gradient too
                for e in entries:
                    if id(e) not in self._pinned:
                        _free(e)

        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)
        for p in params:
            p.register_post_accumulate_grad_hook(grad_ready)


def _home_of(module: nn.Module, param: nn.Parameter) -> tuple[dict, str]:
    """The parameter table of ``module`` (or a submodule) that holds ``param``, and its key
    there: a shadow swaps the entry for a meta twin, so one lookup per forward tells."""
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is param:
                return sub._parameters, name
    raise ValueError(f"a ZeRO-3 unit ({type(module).__name__}) does not hold its parameter of shape "
                     f"{tuple(param.shape)}")


def _tensors_in(output) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or nested in tuples, lists, dicts and
    mappings (Hugging Face's ModelOutput is one)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for x in output for t in _tensors_in(x)]
    return []


def _units(root: nn.Module) -> list[nn.Module]:
    """Blocks first (members of every ModuleList), the root last: a parameter belongs
    to the first unit that contains it. A pipeline's root is the model it runs (the
    stages call the model, never the PipelineParallel wrapper)."""
    from .pipeline.engine import is_pipeline  # (the pipeline imports DDP, which imports this module)
    if is_pipeline(root):
        root = root.module
    blocks = [m for mod in root.modules() if isinstance(mod, nn.ModuleList) for m in mod]
    return blocks + [root]


def _alias(local: torch.Tensor) -> torch.Tensor:
    """A flat tensor over the parameter's storage with a version counter of its own:
    writing through it does not look like an in-place change of the parameter to the
    autograd graph that saved the parameter."""
    return torch.empty(0, dtype=local.dtype, device=local.device).set_(
        local.untyped_storage(), local.storage_offset(), (local.numel(),))


def all_gather_slices(owners: list, slices: list[torch.Tensor], group, into: torch.Tensor | None = None):
    """Yields (owner, rows) for each parameter owner (anything with .param and .slot):
    its DP slices from every rank, `rows` being world x chunk, rank-major, the last rows
    padded. ``slices`` are this rank's slices; one all-gather per dtype and device.
    ``into``: a flat buffer to gather into where it is big enough and of the owners'
    dtype and device (kept from step to step, its pages do not fault on every gather)."""
    return finish_gather_slices(start_gather_slices(owners, slices, group, into))


def start_gather_slices(owners: list, slices: list[torch.Tensor], group, into: torch.Tensor | None = None) -> list:
    """all_gather_slices' collectives, started (asynchronous); finish_gather_slices waits."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    by_kind: dict[tuple, list] = {}
    for owner, mine in zip(owners, slices):
        local = local_of(owner.param)
        by_kind.setdefault((local.dtype, local.device), []).append((owner, mine))
    started = []
    for (dtype, device), members in by_kind.items():
        total = sum(owner.slot.chunk for owner, _ in members)
        if into is not None and into.dtype == dtype and into.device == device and into.numel() >= world * total:
            gathered, into = into[:world * total].view(world, total), None  # (one group of members per buffer)
        else:
            gathered = torch.empty(world, total, dtype=dtype, device=device)
        # gathered in place (as FSDP2 does): this rank's row is the send buffer, so no
        # separate one is alive while the collective runs
        packed = gathered[rank]
        offset = 0
        for owner, mine in members:
            packed[offset:offset + mine.numel()].copy_(mine)
            packed[offset + mine.numel():offset + owner.slot.chunk].zero_()  # padding
            offset += owner.slot.chunk
        started.append(([owner for owner, _ in members], gathered, _all_gather(gathered.view(-1), packed, group)))
    return started


def finish_gather_slices(started: list):
    """Waits for start_gather_slices' collectives; yields (owner, rows) as all_gather_slices."""
    _wait(started)
    for owners, gathered, _ in started:
        offset = 0
        for owner in owners:
            yield owner, gathered[:, offset:offset + owner.slot.chunk]
            offset += owner.slot.chunk


def fill_rows(flat: torch.Tensor, rows: torch.Tensor) -> None:
    """Copies the rank-major ``rows`` (world x chunk, the last ones padded) into ``flat``."""
    world, chunk = rows.shape
    full = min(world, flat.numel() // chunk)
    flat[: full * chunk].view(full, chunk).copy_(rows[:full])
    if full < world:
        tail = flat.numel() - full * chunk
        flat[full * chunk:].copy_(rows[full, :tail])


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group):
    """Started, not waited for: returns the work."""
    # torch 2.13 renames all_gather_into_tensor to all_gather_single; 2.11 has only the former.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    token = _trace.collective_started("all_gather", group, mine, source="zero")
    return _trace.traced(gather(out, mine, group=group, async_op=True), token)


def _wait(started: list) -> None:
    for _, _, work in started:
        work.wait()


def _free(e: _Sharded) -> None:
    """Empties the parameter's storage (keeping the storage object); reading it raises
    from now on, until it is gathered."""
    if released.is_guarded(e.param):  # empty already (emptied early, once its gradients were made)
        return
    local_of(e.param).untyped_storage().resize_(0)
    released.guard(e.param)
