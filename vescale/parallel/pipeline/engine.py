"""``PipelineParallel``: an unmodified model cut into stages over the pipeline dim of a
mesh, trained one schedule per ``step``."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ... import _trace
from ...deferred import has_deferred, is_deferred, materialize_module
from ...device_mesh import DeviceMesh, process_group
from ...dtensor import DTensor
from ...global_loss import items_averaged
from ..._local import local_of
from ..ddp import refuse_thawed
from .p2p import Boundary
from .schedules import Schedule, make_schedule
from .split import Layout, PipelineSplitError, assign_blocks, find_layout
from .stage import StageRunner, StageSpec, is_elsewhere, meta_twin_of
from .weights import StepWeights

SPLIT_METHODS = ("uniform", "parameters", "flops", "time")


class PipelineParallel(nn.Module):
    """``model`` cut into ``mesh.size(pp_dim) * virtual_stages`` stages between its blocks.

    This rank keeps the parameters of its own stages; the others become ``meta`` (with
    ``vescale.deferred_init`` they are never built). ``parameters()``, ``state_dict()`` and
    checkpoints see only this rank's parameters, under the model's own names.

    ``split``: a list of block names that start stages 1, 2, ... (e.g.
    ``["model.layers.8"]``), or a method: ``"uniform"`` (equal block counts),
    ``"parameters"`` (balanced parameter counts, embedding and head included),
    ``"flops"`` / ``"time"`` (balanced forward+backward cost measured on ``sample``, a
    micro-batch of inputs, as ``(args, kwargs)``).

    Apply tensor parallelism to the model after this (``parallelize_module`` leaves the
    other stages' parameters alone); wrap in ``DDP`` / ``DistributedOptimizer`` as usual.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, *, split: str | Sequence[str] = "uniform",
                 schedule: str = "1f1b", microbatches: int = 1, virtual_stages: int = 1,
                 pp_dim: str = "PP", blocks: str | None = None, sample: tuple | None = None):
        super().__init__()
        self.module = model
        self.mesh, self.pp_dim = mesh, pp_dim
        self.pp_size = mesh.size(pp_dim)
        self.pp_rank = mesh.get_local_rank(pp_dim)
        self.group = mesh.get_group(pp_dim)
        self.layout: Layout = find_layout(model, blocks)
        self.schedule: Schedule = make_schedule(schedule, self.pp_size, microbatches, virtual_stages)
        self.ranges = self._ranges(split, sample)
        self.specs = self._specs()
        self.local_stages = self.schedule.stages_of(self.pp_rank)
        self._data_parallel = None   # set by DDP when it wraps this pipeline
        # loss -> the loss backward starts from: a loss-scaling DistributedOptimizer sets its
        # scale_loss here (the schedule runs backward, so the caller cannot scale the loss)
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
        # the last step's loss over the DP replicas where it weighed by items (weights.py)
        self.global_loss: torch.Tensor | None = None
        self._shared = self._strip_other_stages()
        self.runner = StageRunner(model, self.layout, self.specs, self.local_stages, torch.device(mesh.device_type))
        self.boundary = Boundary(self.group, mesh, self.schedule.stages)
        self._checked = False
        self._warned_reentrant = False
        self._broadcast_shared()
        from ..optimizer import GlobalClip  # (the optimizer module imports this one)
        from ..torch_clip import register
        self._clip = GlobalClip(self.parameters, self.pp_size, self)  # (this rank's stages' parameters)
        register(self._clip, self.parameters)  # torch.nn.utils.clip_grad_*: the global norm

    # ---- set-up ----

    def _ranges(self, split, sample) -> list[tuple[int, int]]:
        stages = self.schedule.stages
        if isinstance(split, str) and split not in SPLIT_METHODS:
            raise PipelineSplitError(f"unknown split method {split!r}; use one of {SPLIT_METHODS} or a list of "
                                     f"{stages - 1} block names")
        if isinstance(split, str) and split != "uniform":
            from .profile import block_costs
            costs, pre, post = block_costs(self.module, self.layout, split, sample)
            return assign_blocks(self.layout, stages, split, costs, pre, post)
        return assign_blocks(self.layout, stages, split)

    def _specs(self) -> list[StageSpec]:
        S, layout, specs = len(self.ranges), self.layout, []
        for s, (a, b) in enumerate(self.ranges):
            units = {u.name for u in layout.blocks[a:b]}
            if s == 0:
                units |= {u.name for u in layout.pre}
            if s == S - 1:
                units |= {u.name for u in layout.post}
            specs.append(StageSpec(s, a, b, frozenset(units), s == 0, s == S - 1,
                                   None if s == 0 else layout.blocks[a].name))
        return specs

    def _strip_other_stages(self) -> list[tuple[str, dist.ProcessGroup]]:
        """Tensors of units this rank does not hold become meta; returns the parameters
        that several ranks hold (tied across stages, or glue) by name, each with the
        group of its holders."""
        holders: dict[int, set[int]] = {}
        names: dict[int, str] = {}  # by name: parallelize_module and ZeRO replace the objects later
        for spec in self.specs:
            for unit in self.layout.units:
                if unit.name in spec.units:
                    for name, t in _tensors(unit):
                        holders.setdefault(id(t), set()).add(self.schedule.rank_of(spec.index))
                        names.setdefault(id(t), name)
        everyone = set(range(self.pp_size))
        for name in self.layout.glue_parameters:
            t = self.module.get_parameter(name)
            holders[id(t)], names[id(t)] = everyone, name
        params = {id(p) for p in self.module.parameters()}
        twins: dict[int, torch.Tensor] = {}
        for sub in self.module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, t in list(table.items()):
                    if t is None or id(t) not in holders or self.pp_rank in holders[id(t)]:
                        continue
                    if id(t) not in twins:
                        twins[id(t)] = meta_twin_of(t)
                    table[name] = twins[id(t)]
        shared = [(names[i], sorted(r)) for i, r in holders.items() if len(r) > 1 and self.pp_rank in r and i in params]
        return self._shared_groups(holders, shared)

    def holders(self) -> dict[int, int]:
        """id(parameter) -> how many pipeline ranks hold it, for the parameters that several
        do (tied across stages, or glue). Their gradients are summed over the holders after
        each step's schedule, so every holder has the whole gradient: a global gradient
        norm counts it once, not once per holder."""
        return {id(self.module.get_parameter(name)): dist.get_world_size(group) for name, group in self._shared}

    def _shared_groups(self, holders, shared):
        """A process group per set of holder ranks (at this rank's other mesh coordinates).
        Every rank creates every group, in the same order, as torch.distributed requires."""
        sets = sorted({tuple(sorted(r)) for r in holders.values() if len(r) > 1})
        pp = self.mesh._dim(self.pp_dim)
        groups = {}
        ranks = self.mesh.mesh.movedim(pp, -1).reshape(-1, self.pp_size)
        for members in sets:
            for row in ranks.tolist():
                g = process_group([row[m] for m in members])
                if dist.get_rank() in row:
                    groups[members] = g
        return [(name, groups[tuple(r)]) for name, r in shared]

    # ---- parameters: only this rank's ----

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in self.module.named_parameters(prefix, recurse, remove_duplicate):
            if not is_elsewhere(p):
                yield name, p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, b in self.module.named_buffers(prefix, recurse, remove_duplicate):
            if not is_elsewhere(b):
                yield name, b

    def state_dict(self, *args, **kwargs):
        sd = self.module.state_dict(*args, **kwargs)
        return type(sd)((k, v) for k, v in sd.items() if not is_elsewhere(v))

    def get_submodule(self, target: str) -> nn.Module:
        return self.module.get_submodule(target)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineParallel model trains through step(...) (forward and backward of every "
                           "micro-batch in the schedule's order), not through a call")

    # ---- one training step ----

    def step(self, *args, target=None, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; gradients of this rank's
        parameters are accumulated (``.grad``) as a single-device backward of the batch's
        loss would give them. The batch (``args`` / ``kwargs``, and ``target``) is cut
        into micro-batches along dim 0; every stage needs it (the glue runs everywhere).
        The loss is ``loss_fn(output, target)`` on the micro-batch, else what the model
        returns (a scalar, or an output with ``.loss``); the batch loss is the mean over
        micro-batches weighted by their size, or by their targets where the loss is a mean
        cross-entropy (``weights.py``). Returns it on every rank."""
        mbs = self._checked_microbatches(args, kwargs, target, loss_fn)
        ddp = self._data_parallel
        sync = ddp is not None and ddp._sync  # False inside the user's ddp.no_sync(): accumulate
        # gradients accumulated by earlier steps must not be summed among the holders again
        earlier = {name: self.module.get_parameter(name).grad for name, _ in self._shared}
        for name, _ in self._shared:
            self.module.get_parameter(name).grad = None
        if ddp is not None and self.scale_loss is not None:
            # scale_loss divides the loss's gradient by the DP size at the root, on the last
            # stage; every stage's gradients descend from it: shares, which DDP sums
            ddp.mark_shares()
        weights = StepWeights()
        weights.set_aside(self.parameters(), keep={id(self.module.get_parameter(n)) for n, _ in self._shared})
        sends, states, losses = [], {}, []
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext(), self._root_held():
            for action in self.schedule.orders[self.pp_rank]:
                if action.kind == "F":
                    self._forward(action.stage, action.mb, mbs[action.mb], loss_fn, states, sends, losses, weights)
                elif action.kind in ("B", "I"):
                    self._backward(action.stage, action.mb, states, sends, split=action.kind == "I")
                else:
                    self._backward_weight(action.stage, action.mb, states)
                sends[:] = [w for w in sends if not w[0].is_completed()]  # sent buffers go as they are done
            for work, _ in sends:
                work.wait()
        # parameters unfrozen since DDP was built: found on any stage, refused on every rank
        # (each holds its own stages' parameters), before anything is reduced or stepped
        thawed = ddp.thawed() if ddp is not None else []
        loss = weights.batch_loss(losses, self.group, self.schedule.rank_of(self.schedule.stages - 1), len(thawed))
        weights.rescale(self.parameters(), ddp.group if ddp is not None else None, ddp.world if ddp is not None else 1)
        self.global_loss = weights.global_loss
        if weights.thawed:
            refuse_thawed(thawed or ["some of another pipeline stage's"])
        self._reduce_shared_grads(earlier)
        if sync:
            ddp.sync_gradients()
        return loss

    def evaluate(self, *args, target=None, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor:
        """The batch's loss as ``step`` computes it, forward only (evaluation: call it under
        ``model.eval()`` for dropout's sake): every micro-batch through the stages in the
        schedule's forward order, no backward, no gradients. Returns it on every rank."""
        losses, weights, ddp = [], StepWeights(), self._data_parallel
        self._forwards_only(args, kwargs, target, loss_fn, losses, None, weights)
        loss = weights.batch_loss(losses, self.group, self.schedule.rank_of(self.schedule.stages - 1))
        weights.over_replicas(ddp.group if ddp is not None else None)
        self.global_loss = weights.global_loss
        return loss

    def predict(self, *args, **kwargs):
        """The model's output for the batch, as one device's call returns it, on every rank
        of the pipeline: forward only, in the schedule's forward order, the last stage's
        outputs of the micro-batches joined along dim 0 (a Hugging Face ModelOutput field by
        field; a scalar, such as a loss the model computed from labels, as the batch's mean
        weighted by micro-batch size, or by targets where it is a mean cross-entropy). Values come back as plain, whole tensors (a DTensor
        output is gathered first), without a KV cache (``past_key_values`` is None: the
        stages hold different layers' caches, and ``generate`` through a pipeline is not
        supported). Call it under ``model.eval()`` for dropout's sake."""
        outputs = {}
        mbs = self._forwards_only(args, kwargs, None, None, [], outputs)
        joined = [_joined([outputs[mb] for mb in range(len(mbs))], [mb[3] for mb in mbs]) if outputs else None]
        last = self.schedule.rank_of(self.schedule.stages - 1)
        dist.broadcast_object_list(joined, src=dist.get_global_rank(self.group, last), group=self.group)
        return joined[0]

    def _forwards_only(self, args, kwargs, target, loss_fn, losses: list, outputs: dict | None,
                       weights: StepWeights | None = None) -> list[tuple]:
        """The schedule's forward passes of the batch, nothing else: the last stage's losses
        go to ``losses``, or its outputs to ``outputs`` (a prediction). The micro-batches."""
        sends, states = [], {}
        # Grad mode stays on: what crosses a cut is what requires grad (a stage's own
        # results, not the batch's constants), on both sides alike, and the first call's
        # check of the cuts sees it too. Each forward's graph goes once its outputs are sent.
        # Under torch.inference_mode enable_grad does nothing, so it is left for the call
        # (nothing would cross a cut), and the batch's inference tensors become plain ones.
        with torch.inference_mode(False), torch.enable_grad():
            args, kwargs, target = tree_map(_plain, (args, kwargs, target))
            mbs = self._checked_microbatches(args, kwargs, target, loss_fn, stand_in_loss=outputs is not None)
            # the forwards of any schedule, in its order, are a valid order on their own: a
            # forward waits only for the previous stage's forward of its micro-batch
            with self._root_held():
                for action in self.schedule.orders[self.pp_rank]:
                    if action.kind == "F":
                        self._forward(action.stage, action.mb, mbs[action.mb], loss_fn, states, sends, losses,
                                      weights, outputs=outputs)
                        del states[(action.stage, action.mb)]
                        sends[:] = [w for w in sends if not w[0].is_completed()]
        for work, _ in sends:
            work.wait()
        return mbs

    def _checked_microbatches(self, args, kwargs, target, loss_fn, stand_in_loss: bool = False) -> list[tuple]:
        """The batch cut into micro-batches, the model materialised and its cuts checked
        on meta once (the first step or evaluation)."""
        if has_deferred(self.module):
            materialize_module(self.module)
        mbs = _microbatches(args, kwargs, target, self.schedule.microbatches)
        if not self._checked:  # every stage on meta once: a bad cut fails on every rank alike
            self.runner.install_hooks()  # outermost again, around parallelize_module's
            a, k, t = mbs[0][:3]
            # (a prediction's output need not hold a loss: the check differentiates its sum)
            self.runner.dry_run(self.specs, a, k, _sum_of if stand_in_loss else lambda out: _loss_of(out, t, loss_fn))
            self._checked = True
        return mbs

    def _forward(self, s: int, mb: int, batch, loss_fn, states, sends, losses, weights: StepWeights | None = None,
                 outputs: dict | None = None) -> None:
        """One micro-batch through stage ``s``: sends what crosses the cut; on the last
        stage the loss (``losses``: with its weight and, training, ``weights``' items), or
        the output itself when ``outputs`` collects them."""
        spec = self.specs[s]
        sharded = self._sharded()
        if sharded is not None:  # ZeRO-3's backward prefetch stays within this stage's units
            sharded.restart_forward_order()
        args, kwargs, target, weight = batch
        received, got = None, {}
        if not spec.first:
            def received(stand_ins: list[torch.Tensor]):
                # called at the stage's first block, where its own glue has computed stand-ins
                # of what crosses the cut: their shapes tell which header applies (p2p.py)
                positions, got["leaves"], values = self.boundary.recv_forward(s - 1, mb, stand_ins,
                                                                              self.schedule.rank_of(s - 1))
                return positions, values
        kind, a, b, _ = self.runner.run(spec, args, kwargs, received)
        leaves = got.get("leaves", [])
        if kind == "end":
            roots, works = self.boundary.send_forward(s, mb, self.schedule.rank_of(s + 1), a, b)
            sends += works
        elif outputs is not None:  # a prediction: the output itself, nothing to differentiate
            outputs[mb] = (whole_output(a), _items_of_scalars(a))
            roots = []
        else:
            loss = _loss_of(a, target, loss_fn)
            weighted, items = weights.root(loss, weight) if weights is not None else (loss * weight, None)
            losses.append((loss.detach(), weight, items))
            # weighted, then scaled: the scale multiplies the gradient first, in the loss's
            # dtype, and an fp16 2^16 overflows as one device's does
            roots = [weighted if self.scale_loss is None else self.scale_loss(weighted)]
        states[(s, mb)] = {"outputs": roots, "leaves": leaves}  # what backward starts from

    def _backward(self, s: int, mb: int, states, sends, split: bool) -> None:
        spec, state = self.specs[s], states[(s, mb)]
        outputs = state["outputs"]
        grads = None if spec.last else self.boundary.recv_backward(s, mb, self.schedule.rank_of(s + 1), outputs)
        # the first stage has no input gradient to hurry: it runs its whole backward in I
        if not (split and not spec.first and self._input_half(outputs, grads, state, s)):
            torch.autograd.backward(outputs, grads)
            del states[(s, mb)]
        if not spec.first:
            sends += self.boundary.send_backward(s, mb, self.schedule.rank_of(s - 1), state["leaves"])

    def _input_half(self, outputs, grads, state, s: int) -> bool:
        """Runs the input half of a split backward (torch's split of the autograd graph into
        input- and weight-gradient parts; the weight half is the micro-batch's W). False
        when the graph refuses to be split: a
        ``torch.utils.checkpoint(use_reentrant=True)`` in the model (Hugging Face's
        ``gradient_checkpointing_enable()`` default in older transformers) runs its own
        backward and refuses ``autograd.grad`` with inputs. Nothing was computed then (the
        graph is retained, the hooks removed), and the micro-batch's backward runs whole,
        as the first stage's does; one rank raising while the others wait would hang."""
        from torch.distributed.pipelining._backward import stage_backward_input
        sharded = self._sharded()
        try:
            # ZeRO-3 keeps the units this half gathers whole for the weight half
            with sharded.kept_gathered() if sharded is not None else contextlib.nullcontext():
                _, state["param_groups"] = stage_backward_input(outputs, grads, state["leaves"],
                                                                iter(self._stage_parameters(s)))
            return True
        except RuntimeError as e:
            if "use_reentrant=True" not in str(e.__cause__ or e):
                raise
        if not self._warned_reentrant:
            self._warned_reentrant = True
            warnings.warn("a zero-bubble schedule met torch.utils.checkpoint(use_reentrant=True), which cannot "
                          "split its backward into input and weight halves: those micro-batches run their whole "
                          "backward at once (correct, but without the zero-bubble gain). Pass use_reentrant=False "
                          "(Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                          "{'use_reentrant': False})), or use vescale's own recomputation with another schedule",
                          stacklevel=2)
        return False

    def _backward_weight(self, s: int, mb: int, states) -> None:
        state = states.pop((s, mb), None)
        if state is not None:  # the first stage ran its whole backward in I
            from torch.distributed.pipelining._backward import stage_backward_weight
            weights = self._stage_parameters(s)
            # ZeRO-3 empties a unit's parameters after each forward; the weight pass reads them
            with self._whole(weights):
                stage_backward_weight(iter(weights), state["param_groups"])

    def _whole(self, params: list[nn.Parameter]):
        """ZeRO-3: ``params`` whole for the duration; a no-op without ZeRO-3."""
        sharded = self._sharded()
        return sharded.whole_for(params) if sharded is not None and params else contextlib.nullcontext()

    def _root_held(self):
        """ZeRO-3: the parameters of the model's root unit that this rank holds (embeddings,
        final norm, head, glue) whole for the whole step, gathered once. A stage runs only
        part of the root, so the root's own hooks do not bracket a stage's work: they
        released it after every last-stage forward, and another stage of this rank (ZB-V)
        could empty what a backward then read; gathering it around each backward instead
        moved the embeddings twice a micro-batch."""
        sharded = self._sharded()
        if sharded is None:
            return contextlib.nullcontext()
        return sharded.held(sharded.owned_by_root([p for _, p in self.named_parameters()]))

    def _sharded(self):
        return getattr(self._data_parallel, "sharded_parameters", None)

    def _stage_parameters(self, s: int) -> list[nn.Parameter]:
        """What the weight-gradient half of a split backward differentiates: the stage's
        units' parameters and the glue parameters (looked up at each call: tensor
        parallelism and ZeRO replace parameter objects)."""
        seen, out = set(), []
        units = [u.module for u in self.layout.units if u.name in self.specs[s].units]
        glue = [self.module.get_parameter(n) for n in self.layout.glue_parameters]
        for p in [p for m in units for p in m.parameters()] + glue:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    # ---- parameters several ranks hold ----

    def _broadcast_shared(self) -> None:
        """Tied parameters start equal on every holder (the first holder's values), before
        tensor parallelism or ZeRO split them. A deferred one needs nothing: every rank
        materialises the same values."""
        with torch.no_grad():
            for name, group in self._shared:
                p = self.module.get_parameter(name)
                if not is_deferred(p):
                    _trace.call("broadcast", group, local_of(p), dist.broadcast, local_of(p),
                                src=dist.get_global_rank(group, 0), group=group, source="pipeline")

    def _reduce_shared_grads(self, earlier: dict) -> None:
        """Sums this step's gradients of parameters several ranks hold; adds back what
        earlier steps accumulated (summed already)."""
        for name, group in self._shared:
            p = self.module.get_parameter(name)
            if not p.requires_grad:  # frozen (as on every holder): no gradient, as on one device
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _trace.call("all_reduce", group, local_of(p.grad), dist.all_reduce, local_of(p.grad), group=group,
                        source="pipeline")
            if earlier[name] is not None:
                p.grad = p.grad + earlier[name]


def _plain(x):
    """An inference tensor (made under torch.inference_mode) as a plain one: autograd may
    record ops on it."""
    return x.clone() if isinstance(x, torch.Tensor) and x.is_inference() else x


def is_pipeline(module: nn.Module) -> bool:
    return isinstance(module, PipelineParallel)


def _tensors(unit):
    for prefix, sub in unit.module.named_modules(prefix=unit.name):
        for name, t in list(sub._parameters.items()) + list(sub._buffers.items()):
            if t is not None:
                yield f"{prefix}.{name}", t


def loss_in(output) -> torch.Tensor | None:
    """The loss a model returned: the output itself, its ``.loss`` (Hugging Face's
    ModelOutput) or its ``["loss"]``; None when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    return None


def _loss_of(output, target, loss_fn):
    if loss_fn is not None:
        return loss_fn(output, target)
    loss = loss_in(output)
    if loss is None:
        raise TypeError(f"the model returned {type(output).__name__}, not a loss: pass loss_fn=(output, target) -> "
                        f"loss to PipelineParallel.step")
    if loss.dim() != 0:
        raise ValueError(f"the pipeline's loss must be a scalar, got shape {tuple(loss.shape)}")
    return loss


def _sum_of(output) -> torch.Tensor:
    """A scalar every floating tensor of ``output`` reaches (the cut check's stand-in loss)."""
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise TypeError(f"the model returned {type(output).__name__} with no floating-point tensor to predict")
    return sum(x.sum() for x in leaves)


def whole_output(output):
    """``output`` with every tensor detached and whole (a DTensor gathered: collective over
    its mesh, which every rank of the stage reaches alike), and no KV cache (a Hugging Face
    ``Cache``: under a pipeline it holds the last stage's layers only)."""
    def whole(x):
        if isinstance(x, torch.Tensor):
            return (x.full_tensor() if isinstance(x, DTensor) else x).detach()
        return None if hasattr(x, "get_seq_length") else x
    return tree_map(whole, output)


def _items_of_scalars(output) -> list:
    """Per leaf of ``output``: what a scalar that is a mean cross-entropy averages over
    (``items_averaged``; the forward ran with autograd on), else None."""
    return [items_averaged(x) if isinstance(x, torch.Tensor) and x.dim() == 0 and x.grad_fn is not None else None
            for x in tree_flatten(output)[0]]


def _joined(outputs: list, weights: list[float]):
    """The micro-batches' outputs (each with ``_items_of_scalars``) as the batch's: tensors
    with a batch dim concatenated along it, scalars (a loss) averaged with the
    micro-batches' weights, or by their targets where each is a mean cross-entropy (as
    one device's loss over the batch: a micro-batch of masked targets only counts for
    nothing), anything else taken from the first."""
    flat = [tree_flatten(o) for o, _ in outputs]
    spec = flat[0][1]
    joined = []
    for i, parts in enumerate(zip(*(leaves for leaves, _ in flat))):
        first = parts[0]
        items = [counted[i] for _, counted in outputs]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            joined.append(torch.cat(parts))
        elif isinstance(first, torch.Tensor) and first.is_floating_point() and all(n is not None for n in items):
            n = torch.stack([c.double().cpu() for c in items])
            value = torch.stack([p.double().cpu() for p in parts])
            joined.append((torch.where(n > 0, value * n, 0.0).sum() / n.sum()).to(first.device, first.dtype))
        elif isinstance(first, torch.Tensor) and first.is_floating_point():
            joined.append(sum(p.double() * w for p, w in zip(parts, weights)).to(first.dtype))
        else:
            joined.append(first)
    return tree_unflatten(joined, spec)


def _microbatches(args, kwargs, target, m: int) -> list[tuple]:
    """The batch cut along dim 0 into ``m`` micro-batches: (args, kwargs, target, weight);
    tensors without the batch dim go whole to each."""
    leaves, tree = tree_flatten((args, kwargs, target))
    sizes = [x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not sizes:
        raise ValueError("PipelineParallel.step needs at least one batch tensor (dim 0 = batch) to cut "
                         "into micro-batches")
    batch = sizes[0]
    if batch < m:
        raise ValueError(f"a batch of {batch} cannot be cut into {m} micro-batches; give at least {m} samples")
    cut = [torch.tensor_split(x, m) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else None
           for x in leaves]
    out = []
    for i in range(m):
        mine = [c[i] if c is not None else x for c, x in zip(cut, leaves)]
        n = next(c[i].shape[0] for c in cut if c is not None)
        a, k, t = tree_unflatten(mine, tree)
        out.append((a, k, t, n / batch))
    return out
