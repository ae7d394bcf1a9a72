"""DistributedOptimizer: ZeRO over the data-parallel group of DDP-wrapped models.

    model = DDP(model, mesh["DP"])
    optimizer = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=1e-3, zero_stage=2)

Every parameter's local tensor (a DTensor's shard, or the plain tensor) is split into
DP slices; this rank keeps an fp32 master copy of its slice and runs the wrapped
optimizer, unchanged, on those slices only, so optimizer state and master weights
take 1/DP of the memory. After the step the updated slices are all-gathered back into
the parameters (in their own dtype: bf16/fp16 compute, fp32 master weights).

    zero_stage=1  gradients are all-reduced (DDP), each rank reads its slice
    zero_stage=2  gradients are reduce-scattered as backward produces them; only the
                  slice stays (DDP(reduce_scatter=True), set up here)
    zero_stage=3  parameters too live as slices, gathered only while a module that
                  owns them runs forward or backward (vescale.parallel.zero3)

The wrapped optimizer must update each element from that element's state alone
(SGD, Adam, AdamW, Adagrad, ...): it sees flat slices, not the parameters' shapes.
``loss_scale="dynamic"`` adds fp16 loss scaling: ``scale_loss(loss)`` before
backward; ``step()`` skips the update on every rank when any rank finds an inf/NaN
gradient, and adapts the scale.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..deferred import flat_slice
from ..dtensor import DTensor
from .._local import local_of
from .ddp import DDP, Slot, as_shares
from . import torch_clip
from .grad_norm import NormOverRanks
from .pipeline.engine import is_pipeline
from .zero3 import ShardedParameters, all_gather_slices, fill_rows

__all__ = ["DistributedOptimizer"]


@dataclass
class Owned:
    """This rank's slice [start, end) of one parameter's flat local tensor."""
    param: nn.Parameter
    slot: Slot
    start: int
    end: int
    master: nn.Parameter


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer_cls, models, *, zero_stage: int = 1, loss_scale: str | float | None = None,
                 param_groups: list[dict] | None = None, **optimizer_kwargs):
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        refuse_whole_tensor_optimizer(optimizer_cls)
        models = list(models)
        if not models or not all(isinstance(m, DDP) for m in models):
            raise TypeError("DistributedOptimizer shards over the data-parallel group of DDP models: "
                            "pass models=[DDP(model, mesh['DP'])]")
        self.ddps = models
        self.group = models[0].group
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.zero_stage = zero_stage
        for ddp in models:
            if zero_stage >= 2:
                ddp.shard_gradients()
            if zero_stage < 3:  # stages 1 and 2 hold whole parameters
                ddp.materialize()
        self.owned: list[Owned] = []
        slices: dict[int, torch.Tensor] = {}
        for ddp in models:
            for bucket in ddp.buckets:
                for slot in bucket.slots:
                    start = min(self.rank * slot.chunk, slot.numel)
                    end = min(start + slot.chunk, slot.numel)
                    values = flat_slice(slot.param, start, end)  # only the slice, for a deferred model
                    if values.dtype == torch.float32 and zero_stage < 3:
                        # fp32 parameters are their own master weights: a view of the
                        # parameter, updated in place (no copy of the slice)
                        master = nn.Parameter(values.detach())
                    else:  # ZeRO-3's slice of an fp32 parameter is the master itself
                        master = nn.Parameter(values.detach().to(torch.float32, copy=True))
                    self.owned.append(Owned(slot.param, slot, start, end, master))
                    slices[id(slot.param)] = master.detach() if values.dtype == torch.float32 else values.clone()
        self.inner = optimizer_cls(self._master_groups(param_groups), **optimizer_kwargs)
        self.sharded = None
        if zero_stage == 3:
            self.sharded = ShardedParameters([ddp.module for ddp in models],
                                             [(o.slot, o.start, o.end, slices[id(o.param)]) for o in self.owned],
                                             self.group)
            for ddp in models:  # deferred buffers, whole
                ddp.materialize()
                ddp.sharded_parameters = self.sharded  # (a pipeline under it gathers for its weight passes)
        # Present the wrapped optimizer's groups and state as ours (LR schedulers, logging).
        super().__init__([{"params": [o.master for o in self.owned]}], self.inner.defaults)  # (maybe none)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.scaler = _LossScaler(loss_scale) if loss_scale is not None else None
        if self.scaler is not None:
            for ddp in models:  # a pipeline runs backward itself: it scales each micro-batch's loss
                if is_pipeline(ddp.module):
                    ddp.module.scale_loss = self.scale_loss
        torch_clip.register(self, lambda: [o.param for o in self.owned])  # torch.nn.utils.clip_grad_* on them
        # and on param_groups' parameters (the masters, whose .grad step() sets): a loop that
        # clips what its optimizer holds found no gradient there, norm 0, nothing clipped
        self._masters_clip = _MastersClip(self)
        torch_clip.register(self._masters_clip, lambda: [o.master for o in self.owned])

    def _master_groups(self, param_groups: list[dict] | None):
        """The masters in the caller's parameter groups (their options kept), or one group."""
        if param_groups is None:
            return [{"params": [o.master for o in self.owned]}]  # (a group: a pipeline stage may hold none)
        master_of = {id(o.param): o.master for o in self.owned}
        groups, seen = [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"param_groups[{i}] must be a dict with 'params' (and options such as "
                                f"'weight_decay'), as torch.optim takes, got {g!r}")
            masters = []
            for p in g["params"]:
                if id(p) not in master_of and not p.requires_grad:
                    continue  # frozen: no DDP slot, and torch's optimizer would never step it (no .grad)
                if id(p) not in master_of:
                    raise ValueError(f"param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                     f"parameter of the DDP models this optimizer was given")
                if id(p) in seen:
                    raise ValueError(f"param_groups[{i}] repeats a parameter of shape {tuple(p.shape)}; every "
                                     f"parameter belongs to one group")
                seen.add(id(p))
                masters.append(master_of[id(p)])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        # a parameter in no group gets gradients and is never stepped, as on one device
        return groups

    def add_param_group(self, param_group: dict) -> None:
        """A group of the model's parameters, as torch's optimizers take one (gradual
        unfreezing, a second phase that trains more of the model): stepped through this
        rank's master slices. (torch's own add_param_group put the parameters themselves
        in the wrapped optimizer, which under ZeRO-2/3 never sees their gradients: they
        were never stepped, silently.)"""
        if presenting_groups(self):
            return super().add_param_group(param_group)
        self.inner.add_param_group(self._master_groups([{**param_group, "params": group_params(param_group)}])[0])

    # ---- the step ----

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale, whose backward starts from this rank's share of the DP
        average (``ddp.as_shares``): a rank's fp16 gradients stay as small as one device's."""
        return as_shares(loss, self.ddps) * self.scaler.scale if self.scaler else loss

    # torch.amp.GradScaler: calls step() itself (with grad_scale / found_inf set) instead
    # of unscaling .grad, which this optimizer's masters do not hold before step()
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        refuse_grad_scaler(self)
        loss = closure() if closure is not None else None
        self.refresh_masters()
        for o in self.owned:
            grad = self._grad_slice(o)
            o.master.grad = None if grad is None else grad.to(torch.float32)
        if self.scaler is not None:
            stepped = self._stepped()
            # (a parameter in no group: its gradient is not the step's business, as with torch's GradScaler)
            if not self.scaler.unscale_and_check([o.master.grad for o in self.owned
                                                  if o.master.grad is not None and id(o.master) in stepped]):
                return loss  # inf/NaN somewhere: every rank skips this step
        self.inner.step()
        if self.sharded is not None:
            for o in self.owned:  # the next forward gathers them
                if o.param.dtype != torch.float32:  # (an fp32 slice is the master)
                    self.sharded.slice_of(o.param).copy_(o.master.detach())
            # a whole copy still held (a pipeline stage's forward ends before its root
            # module's does, so that unit is never released) is stale now
            self.sharded.release(list(self.sharded.sharded.values()))
        else:
            self._gather_parameters()
        return loss

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """The fp32 masters of bf16/fp16 parameters take the elements written into the
        parameters since the last step (an in-place edit between steps, a write inside
        ``full_parameters()``, ``model.load_state_dict``), as on one device, where the
        parameter itself is what steps; the others keep their fp32 digits. Without this
        the next step wrote the old masters back over the edit, silently. (An fp32
        parameter's slice is its own master.) Every step starts with it; a save too."""
        for o in self.owned:
            if o.param.dtype == torch.float32:
                continue
            held = self.sharded.slice_of(o.param) if self.sharded is not None else flat_slice(o.param, o.start,
                                                                                              o.end)
            written = held != o.master.to(held.dtype)
            o.master.copy_(torch.where(written, held.to(torch.float32), o.master))

    def full_parameters(self):
        """A context in which ZeRO-3 parameters are whole, to read or edit (edits are kept; a
        no-op for stages 1 and 2)."""
        return self.sharded.whole() if self.sharded is not None else contextlib.nullcontext()

    def _grad_slice(self, o: Owned) -> torch.Tensor | None:
        if self.zero_stage >= 2:
            for ddp in self.ddps:
                shard = ddp.grad_shards.get(id(o.param))
                if shard is not None:
                    return shard[: o.end - o.start]
            return None
        if o.param.grad is None:
            return None
        return local_of(o.param.grad).reshape(-1)[o.start:o.end]

    def _gather_parameters(self) -> None:
        """All-gather the updated slices, one collective per DDP bucket (and dtype): the
        transient buffer is one bucket's, not the whole model's. ZeRO-1 gathers into the
        bucket's all-reduce buffer, idle from the end of backward to the next one."""
        by_bucket: dict[int, tuple] = {}
        for o in self.owned:
            bucket = self._bucket(o)
            by_bucket.setdefault(id(bucket), (bucket, []))[1].append(o)
        for bucket, owned in by_bucket.values():
            into = bucket.kept if self.zero_stage == 1 else None
            for o, rows in all_gather_slices(owned, [o.master.detach() for o in owned], self.group, into):
                fill_rows(local_of(o.param).view(-1), rows)

    def _stepped(self) -> set[int]:
        """ids of the masters in the wrapped optimizer's groups (read now: groups may change)."""
        return {id(m) for g in self.inner.param_groups for m in g["params"]}

    def _bucket(self, o: Owned):
        return next(b for ddp in self.ddps if (b := ddp.bucket_of(o.param)) is not None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of the parameters this optimizer steps, as torch's zero_grad: those
        in no group keep theirs (``model.zero_grad()`` clears every one)."""
        stepped = self._stepped()
        for o in self.owned:
            if id(o.master) in stepped:
                o.param.grad = None
                o.master.grad = None
                for ddp in self.ddps:
                    ddp.grad_shards.pop(id(o.param), None)

    # ---- memory, norms and state ----

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients, fp32 master weights
        (none where the parameters are fp32: they are their own masters) and the inner
        optimizer's state; each storage counted once."""
        counted: set[int] = set()  # storages, each once (views: grad slices, fp32 masters)

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = local_of(t).untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in counted:
                    counted.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = nbytes(o.param for o in self.owned)
        if self.sharded is not None:
            params += nbytes(self.sharded.slice_of(o.param) for o in self.owned)
        grads = nbytes(o.param.grad for o in self.owned)
        grads += nbytes(s for ddp in self.ddps for s in ddp.grad_shards.values())
        master = nbytes(o.master for o in self.owned)  # 0 where the master is the parameter
        state = nbytes(v for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "master": master, "optimizer_state": state}

    # ---- norms and state ----

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the global gradient norm over every rank; returns that norm.

        Call after backward, before step(). Elements a DTensor replicates across its mesh
        are counted once. With a loss scale, the gradients (still scaled until step()) are
        clipped by their unscaled norm, which is what it returns.
        """
        scale = self.scaler.scale if self.scaler is not None else 1.0
        slices = [(o, self._grad_slice(o)) for o in self.owned]
        # Summed over every rank: DP ranks split each local tensor (their sums give whole
        # local tensors); a DTensor's local tensors sum over its mesh, its replicated dims
        # counted once; a plain parameter is the same on every rank at the same DP and
        # pipeline coordinates (pipeline stages hold different ones); a parameter several
        # pipeline ranks hold counts once, not once per holder.
        holders = pipeline_holders(self.ddps)
        plain_copies = dist.get_world_size() // (self.world * pipeline_size(self.ddps))
        norm = NormOverRanks(norm_type, collective_device())
        for o, g in slices:
            if g is not None:
                norm.add(g, holders.get(id(o.param), 1) * (_copies(o.param) if isinstance(o.param, DTensor)
                                                             else plain_copies))
        norm = norm.over_ranks(source="optimizer") / scale
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for o, g in slices:
                if g is not None:
                    self._whole_grad_or(o, g).mul_(coef)
        return norm.float()

    def _whole_grad_or(self, o: Owned, g: torch.Tensor) -> torch.Tensor:
        """ZeRO-1: the whole local gradient that the slice ``g`` views (every DP rank holds
        it alike): a gradient kept past the step (a parameter in no group, which zero_grad
        leaves as torch's does) must be clipped everywhere, not in this rank's slice only.
        ZeRO-2/3: the slice, all there is."""
        return local_of(o.param.grad) if self.zero_stage == 1 else g

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamps every gradient element to [-clip_value, clip_value] (this rank's slices:
        elementwise, no collective); with a loss scale, the scaled gradients to the scaled
        bounds. Call after backward, before step()."""
        bound = float(clip_value) * (self.scaler.scale if self.scaler is not None else 1.0)
        for o in self.owned:
            g = self._grad_slice(o)
            if g is not None:
                self._whole_grad_or(o, g).clamp_(-bound, bound)

    def state_dict(self) -> dict:
        """This rank's: its slices' state and masters (of its TP shard and pipeline stage)."""
        return {"inner": self.inner.state_dict(), "zero_stage": self.zero_stage, "dp_world": self.world,
                "dp_rank": self.rank, "loss_scale": self.scaler.state_dict() if self.scaler else None,
                "rank": dist.get_rank(), "world": dist.get_world_size(),
                "masters": [o.master.detach().clone() for o in self.owned]}

    def load_state_dict(self, state: dict) -> None:
        # the global rank too: another TP or pipeline rank of the same DP rank holds slices
        # of the same shapes (another shard, another stage), which would load silently
        saved = (state.get("dp_world"), state.get("dp_rank"), state.get("world", dist.get_world_size()),
                 state.get("rank", dist.get_rank()))
        if saved != (self.world, self.rank, dist.get_world_size(), dist.get_rank()):
            raise ValueError(f"this optimizer state was saved by rank {saved[3]} of {saved[2]} (DP rank {saved[1]} "
                             f"of {saved[0]}); this is rank {dist.get_rank()} of {dist.get_world_size()} (DP rank "
                             f"{self.rank} of {self.world}). Under ZeRO each rank holds its own part: load each "
                             "rank's own optimizer.state_dict(), or save and load with vescale.save / vescale.load, "
                             "which reshard")
        self.inner.load_state_dict(state["inner"])
        for o, m in zip(self.owned, state["masters"]):
            o.master.data.copy_(m)
        if self.scaler and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])


def presenting_groups(wrapper: torch.optim.Optimizer) -> bool:
    """Whether torch.optim.Optimizer.__init__ is running on ``wrapper`` (an optimizer that
    presents its ``inner`` one's groups as its own): its add_param_group calls are torch's."""
    return "inner" not in vars(wrapper) or wrapper.param_groups is not wrapper.inner.param_groups


def group_params(param_group: dict) -> list:
    """A parameter group's parameters as a list (torch takes one tensor or an iterable)."""
    params = param_group["params"]
    return [params] if isinstance(params, torch.Tensor) else list(params)


class _MastersClip:
    """torch.nn.utils.clip_grad_* over a DistributedOptimizer's own parameters (its master
    slices) clip as over the model's: by the global norm of the gradients."""

    def __init__(self, optimizer: DistributedOptimizer):
        self.optimizer = optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        self.optimizer.clip_grad_value_(clip_value)


# Optimizers whose update of an element reads more than that element's state: statistics
# over a matrix's rows and columns (Adafactor, Shampoo, SOAP), its orthogonalisation
# (Muon), a per-tensor trust ratio or norm (LAMB, LARS, NovoGrad) or the whole model (L-BFGS). On ZeRO's
# flat slices Adafactor silently took its 1-D path (losses 1e-4 off by the third step),
# Muon refused the 2-D parameters it was given. Matched by class name, to cover the
# libraries' versions (transformers' Adafactor, apex's FusedLAMB) as well as torch's.
_WHOLE_TENSOR_OPTIMIZER = re.compile(r"(fused|deepspeed|distributed|onebit|paged)?"
                                     r"(adafactor|shampoo|soap|muon|lamb|lars|novograd|lbfgs|sparseadam)(8bit|32bit)?")


def refuse_whole_tensor_optimizer(optimizer_cls) -> None:
    name = getattr(optimizer_cls, "__name__", str(optimizer_cls))
    if _WHOLE_TENSOR_OPTIMIZER.fullmatch(name.lower()):
        raise ValueError(
            f"{name} updates an element from statistics of the whole parameter (its rows and columns, its norm, "
            "or the whole model), and ZeRO runs the optimizer on flat slices of the parameters, which would "
            f"change that math: use {name} without ZeRO (plan key data_parallel.zero_stage: 0; tensor "
            "parallelism keeps it exact), or an optimizer that updates each element from its own state alone "
            "(AdamW, Adam, SGD, Adagrad, RMSprop, ...) with ZeRO")


def _pipelines(models) -> list:
    """The pipelines among ``models`` (DDP-wrapped or not)."""
    from .pipeline.engine import is_pipeline  # (the pipeline imports DDP, which imports this module)
    unwrapped = [m.module if isinstance(m, DDP) else m for m in models]
    return [m for m in unwrapped if is_pipeline(m)]


def pipeline_holders(models) -> dict[int, int]:
    """id(parameter) -> how many pipeline ranks hold it, over the pipelines among
    ``models``; parameters not listed have one holder."""
    holders: dict[int, int] = {}
    for pipeline in _pipelines(models):
        holders.update(pipeline.holders())
    return holders


def pipeline_size(models) -> int:
    """The number of pipeline ranks that ``models`` are split over (1: no pipeline)."""
    return max((p.pp_size for p in _pipelines(models)), default=1)


def grad_norm(params, norm_type: float, ranks_per_stage: int, holders: dict[int, int] | None = None) -> torch.Tensor:
    """The norm of the gradients of ``params`` across every rank, each element counted
    once: a DTensor's elements once per copy its mesh replicates, its mesh's copies
    across the rest of a stage's ``ranks_per_stage`` ranks (data parallelism), a plain
    gradient held by every rank of a stage, and a parameter several pipeline ranks hold
    (``holders``: id -> count, see ``pipeline_holders``), all divided out."""
    holders = holders or {}
    norm = NormOverRanks(norm_type, collective_device())
    for p in params:
        copies = (_copies(p) * (ranks_per_stage // p.device_mesh.mesh.numel()) if isinstance(p, DTensor)
                  else ranks_per_stage)
        norm.add(local_of(p.grad), holders.get(id(p), 1) * copies)
    return norm.over_ranks()


class GlobalClip:
    """Clipping of gradients that live whole in ``.grad`` (no ZeRO), each rank's parts of
    them (TP shards, pipeline stages) by the norm over every rank. A PipelineParallel
    registers one for its parameters with torch_clip (a script's own optimizer: torch's
    clip would see one stage's norm); an optimizer of vescale's takes them over."""

    def __init__(self, parameters, pp_size: int, pipeline=None):
        """``parameters()``: the parameters, read at each call."""
        self.parameters, self.pp_size, self.pipeline = parameters, pp_size, pipeline

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = [p for p in self.parameters() if p.grad is not None]
        world = dist.get_world_size() if dist.is_initialized() else 1
        norm = grad_norm(params, norm_type, ranks_per_stage=world // self.pp_size,
                         holders=self.pipeline.holders() if self.pipeline is not None else None)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in params:
                local_of(p.grad).mul_(coef)
        return norm.float()

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        for p in self.parameters():
            if p.grad is not None:
                local_of(p.grad).clamp_(-clip_value, clip_value)


def collective_device() -> torch.device:
    """Where a tensor must live for the default process group's collectives: NCCL's on this
    rank's current GPU, gloo's (and a run without torch.distributed) on the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _copies(param: DTensor) -> int:
    """How many ranks of its mesh hold each element of a DTensor (replicated dims)."""
    copies = 1
    for p, size in zip(param.placements, param.device_mesh.shape):
        if not p.splits():
            copies *= size
    return copies


def refuse_grad_scaler(optimizer) -> None:
    """Raises where torch.amp.GradScaler drives ``optimizer.step()`` (it sets these two
    attributes first): its unscale and inf check read each rank's own ``.grad``, which
    ZeRO's masters hold only inside step() (its check found nothing to check), and where
    an inf in one rank's gradients (a ZeRO slice, a pipeline stage's) must skip the step
    on every rank, as one device skips it, the others would step."""
    if hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"):
        for name in ("grad_scale", "found_inf"):
            optimizer.__dict__.pop(name, None)
        raise RuntimeError(
            "torch.amp.GradScaler cannot scale this optimizer's step: its gradients live apart across ranks "
            "(ZeRO slices kept apart from .grad until step(), or a pipeline's stages), and an inf in one rank's "
            "part must skip the step on every rank. Use vescale's loss scaling instead: "
            "DistributedOptimizer(..., loss_scale='dynamic') with opt.scale_loss(loss).backward() and opt.step() "
            "(vescale.parallelize: the plan key mixed_precision.loss_scale, with data_parallel.zero_stage >= 1). "
            "Nothing was stepped.")


class _LossScaler:
    """Dynamic loss scaling: halves on overflow (skipping the step), doubles after
    `growth_interval` clean steps."""

    def __init__(self, init: str | float, growth_interval: int = 1000):
        self.scale = 2.0**16 if init == "dynamic" else float(init)
        self.dynamic = init == "dynamic"
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        found = torch.zeros(1, device=collective_device())
        for g in grads:
            g.div_(self.scale)
            if not torch.isfinite(g).all():
                found.fill_(1.0)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # any rank's overflow skips the step everywhere
        ok = found.item() == 0.0
        if not ok and not self.dynamic:
            warnings.warn(f"vescale: an inf or NaN gradient at the fixed loss_scale {self.scale:g} skipped this step "
                          f"on every rank; a scale that overflows every step never trains: lower it, or use "
                          f"loss_scale='dynamic', which halves on overflow", stacklevel=3)
        if self.dynamic:
            if not ok:
                self.scale /= 2.0
                self.clean_steps = 0
            else:
                self.clean_steps += 1
                if self.clean_steps % self.growth_interval == 0:
                    self.scale *= 2.0
        return ok

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
