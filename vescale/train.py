"""``vescale.parallelize``: the veScale RFC's single call from a plan to a training setup.

    model, optimizer, scheduler, data_loader = vescale.parallelize(plan, model, optimizer_fn,
                                                                   lr_scheduler_fn, dataset)
    for batch in data_loader:
        optimizer.zero_grad(); loss = model(batch); loss.backward(); optimizer.step()
    scheduler.step()

What each section of the plan becomes (``vescale.Plan``):

- ``mesh``: the device mesh, its dims in the order given (the default: every rank in "DP").
- ``pipeline_parallel`` (its dim's size > 1): ``PipelineParallel`` cuts the model. A
  schedule interleaves the forward and backward passes of its micro-batches, so under a
  pipeline ``model(batch)`` runs the whole schedule, forward and backward, and returns
  the batch loss with the gradients already accumulated; ``loss.backward()`` then has
  nothing left to do (the loss is a leaf). In eval mode or under ``torch.no_grad()`` it
  evaluates: the schedule's forward passes only, and returns the batch loss (not the
  outputs).
- ``tensor_parallel``: ``parallelize_module`` with the plan's sharding plan on its dim
  (a ``deferred_init`` model is materialised straight into its shards).
- ``mixed_precision.param_dtype``: the model's floating parameters take that dtype; the
  optimizer (ZeRO, stage >= 1 required) keeps fp32 master weights. ``loss_scale`` scales
  the gradient of the loss in backward (the loss value is not scaled) and unscales
  before the step, skipping steps with inf/NaN gradients.
- ``data_parallel``: ``DDP`` over its dim; ``zero_stage`` 1-3 makes the optimizer a
  ``DistributedOptimizer``.
- ``gradient.accumulation_steps`` k: every call of ``model(batch)`` is one micro-step;
  the DP reduction runs at the k-th backward, ``optimizer.step()`` applies at the k-th
  call (the first k-1 return at once) and ``zero_grad()`` clears only after it. The
  gradient is that of the mean loss over the k micro-steps. ``clip_norm``: the global
  gradient norm over every rank is clipped before each applied step.
- ``recompute.modules``: those modules (regexes over names) recompute their activations
  in backward (``torch.utils.checkpoint``, non-reentrant); under a pipeline with GPipe,
  1F1B or interleaved 1F1B (the zero-bubble schedules' split backward would recompute a
  block once per weight-gradient pass: refused).
- ``data``: with a dataset, a ``vescale.DataLoader`` of ``global_batch_size`` samples per
  step, each DP rank reading its part.

``model(batch)`` calls the user's model with ``**batch`` for a dict, ``*batch`` for a
tuple or list, else ``batch``. The loss it returns (the model's output when that is a
scalar, or ``output.loss``) is the global one, one device's loss over the global batch:
each DP rank's loss weighted by the items it averages over where it is a mean-reduced
cross-entropy (targets not ignored: padding and masked prompts differ between ranks),
else by its rows (the last, smaller batch of a ``drop_last=False`` loader splits
unevenly, and a rank may have none); see ``vescale.global_loss``. The gradient is
weighted alike. Under a pipeline, uneven batches over the DP ranks are refused on every
rank (the schedule runs backward itself, unweighted). A forward that raises on some DP
ranks only (a model that cannot take an empty batch) raises on every DP rank where they
can learn it in the loss's all-reduce (``global_loss.DPLoss.tell_others``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ._compile import keep_losses_eager
from .deferred import cast_deferred, materialize_before_reading
from .device_mesh import DeviceMesh, init_device_mesh
from .dtensor import DTensor
from .global_loss import DPLoss, items_averaged, items_seen, rows_of
from .parallel.ddp import DDP, as_shares, local_of
from .parallel import torch_clip
from .parallel.optimizer import (DistributedOptimizer, GlobalClip, group_params, presenting_groups,
                                 refuse_grad_scaler)
from .parallel.parallelize import parallelize_module
from .parallel.pipeline.engine import PipelineParallel, whole_output
from .plan import Plan, PlanError

__all__ = ["parallelize", "ParallelModel", "ParallelOptimizer"]


def parallelize(plan: Plan | dict, model: nn.Module, optimizer_fn: Callable | None = None,
                lr_scheduler_fn: Callable | None = None, dataset=None, *, collate_fn: Callable | None = None):
    """Lays ``model`` out as ``plan`` says and returns ``(model, optimizer, scheduler,
    data_loader)`` (the last three None when their factory or dataset is not given).
    ``collate_fn`` makes a batch of a list of samples, for the data loader (default:
    ``torch.utils.data.default_collate``), e.g. padding each batch to its longest sample.

    ``optimizer_fn`` makes the optimizer: an optimizer class or ``functools.partial`` of one
    is called with the parameters; any other callable with the (parallelised) model, so it
    may build parameter groups (nanoGPT's ``configure_optimizers``). ``lr_scheduler_fn``
    is called with the returned optimizer. Every rank must call this alike."""
    plan = plan if isinstance(plan, Plan) else Plan(plan)
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan.validate(world_size=world, model=model)
    mesh = _mesh(plan, world)
    dims = mesh.mesh_dim_names
    size = {d: mesh.size(d) for d in dims}
    pp, tp, dp = (plan[f"{s}.dim"] for s in ("pipeline_parallel", "tensor_parallel", "data_parallel"))
    zero = plan["data_parallel.zero_stage"]
    mp_dtype = plan["mixed_precision.param_dtype"]
    _check_combination(plan, size, pp, dp, zero, mp_dtype)

    if mp_dtype is not None:
        cast_deferred(model, getattr(torch, mp_dtype))  # (a deferred model stays deferred)
        model.to(getattr(torch, mp_dtype))
    inner: nn.Module = model
    pipeline = None
    if size.get(pp, 1) > 1:
        p = plan.pipeline_parallel
        split = p.split_points or p.split_method
        pipeline = PipelineParallel(model, mesh, split=split, schedule=p.schedule,
                                    microbatches=p.microbatches, virtual_stages=p.virtual_stages, pp_dim=pp,
                                    blocks=p.blocks,
                                    sample=_sample_microbatch(plan, split, dataset, size.get(dp, 1), collate_fn))
        inner = pipeline
    sharding = plan["tensor_parallel.sharding_plan"]
    if sharding and tp in size:
        parallelize_module(model, mesh[tp], sharding)
    _recompute(model, plan["recompute.modules"])
    ddp = None
    if dp in size:
        ddp = DDP(inner, mesh[dp], bucket_cap_mb=plan["data_parallel.bucket_cap_mb"])
        inner = ddp

    steps = _Steps(plan["gradient.accumulation_steps"])
    optimizer = None
    if optimizer_fn is not None:
        optimizer = _optimizer(optimizer_fn, model, pipeline or model, ddp, zero,
                               plan["mixed_precision.loss_scale"])
        optimizer = ParallelOptimizer(optimizer, steps, plan["gradient.clip_norm"], mesh, pp,
                                      (pipeline or model).parameters, pipeline,
                                      materialize=functools.partial(materialize_before_reading, inner))
    scaler = getattr(getattr(optimizer, "inner", None), "scaler", None)
    zero_optimizer = getattr(optimizer, "inner", None)
    wrapped = ParallelModel(inner, pipeline, ddp, mesh, dp, steps, scaler, zero3=zero == 3,
                            zero_optimizer=zero_optimizer if isinstance(zero_optimizer, DistributedOptimizer) else None)
    if optimizer is not None:
        optimizer.clips(wrapped)
    scheduler = lr_scheduler_fn(optimizer) if lr_scheduler_fn is not None else None
    loader = None
    if dataset is not None:
        from .data import DataLoader
        d = plan.data
        if d.global_batch_size is None:
            raise PlanError("vescale.parallelize got a dataset but the plan has no data.global_batch_size; set it, "
                            "e.g. Plan({..., 'data.global_batch_size': 32})")
        loader = DataLoader(dataset, mesh, global_batch_size=d.global_batch_size, dp_dim=dp, shuffle=d.shuffle,
                            seed=d.seed, drop_last=d.drop_last, collate_fn=collate_fn)
    return wrapped, optimizer, scheduler, loader


# ---- set-up helpers ------------------------------------------------------------------------

def _mesh(plan: Plan, world: int) -> DeviceMesh:
    dims = dict(plan["mesh"]) or {plan["data_parallel.dim"]: world}
    device = "cuda" if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, tuple(dims.values()), mesh_dim_names=tuple(dims))


def _check_combination(plan: Plan, size: dict, pp: str, dp: str, zero: int, mp_dtype) -> None:
    if zero > 0 and dp not in size:
        raise PlanError(f"plan key data_parallel.zero_stage is {zero} but the mesh {plan['mesh']} has no "
                        f"data-parallel dim {dp!r}; add it (size 1 is fine) or set zero_stage 0")
    if mp_dtype is not None and zero == 0:
        raise PlanError(f"plan key mixed_precision.param_dtype is {mp_dtype!r}: the fp32 master weights live in "
                        f"the ZeRO optimizer; set data_parallel.zero_stage to 1, 2 or 3")
    if plan["mixed_precision.loss_scale"] is not None and zero == 0:
        raise PlanError("plan key mixed_precision.loss_scale needs the ZeRO optimizer; set data_parallel.zero_stage "
                        "to 1, 2 or 3")
    if size.get(pp, 1) > 1:
        if plan["gradient.accumulation_steps"] > 1:
            raise PlanError("plan key gradient.accumulation_steps > 1 with a pipeline: a pipeline step already "
                            "accumulates over its micro-batches; raise pipeline_parallel.microbatches instead")
        if plan["recompute.modules"] and plan["pipeline_parallel.schedule"] in ("zb_h1", "zbv"):
            raise PlanError(f"plan key recompute.modules with the zero-bubble schedule "
                            f"{plan['pipeline_parallel.schedule']!r} is not supported: its split backward would "
                            f"recompute every block once per weight-gradient pass (measured: 8 forwards of a block per "
                            f"micro-batch, against 2 under 1F1B); "
                            f"use schedule '1f1b', 'interleaved_1f1b' or 'gpipe' with recomputation")


def _sample_microbatch(plan: Plan, split, dataset, dp_size: int, collate_fn: Callable | None = None):
    """A micro-batch of the dataset as the pipeline's cost-measured split methods take it
    (``(args, kwargs)``, only its shapes and dtypes are used), or None where the split
    needs none."""
    if split not in ("flops", "time"):
        return None
    if dataset is None or plan["data.global_batch_size"] is None:
        raise PlanError(f"plan key pipeline_parallel.split_method is {split!r}, which measures the model on a "
                        f"micro-batch: pass the dataset to vescale.parallelize (with data.global_batch_size "
                        f"set), or split by 'parameters' or 'uniform', or name pipeline_parallel.split_points")
    rows = max(1, plan["data.global_batch_size"] // dp_size // plan["pipeline_parallel.microbatches"])
    collate = collate_fn or torch.utils.data.default_collate
    batch = collate([dataset[i] for i in range(min(rows, len(dataset)))])
    if isinstance(batch, dict):
        return (), dict(batch)
    return (tuple(batch), {}) if isinstance(batch, (tuple, list)) else ((batch,), {})


def _recompute(model: nn.Module, patterns: list[str]) -> None:
    if not patterns:
        return
    hits = [(n, m) for n, m in model.named_modules() if any(re.fullmatch(p, n) for p in patterns)]
    if not hits:
        raise PlanError(f"plan key recompute.modules {patterns} matches no module of {type(model).__name__}; "
                        f"patterns match whole names such as {[n for n, _ in model.named_modules()][1:4]}")
    for _, module in hits:
        forward = module.forward
        module.forward = functools.wraps(forward)(
            lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k) if torch.is_grad_enabled()
            else _f(*a, **k))


def _optimizer(optimizer_fn, user_model, holder, ddp, zero: int, loss_scale):
    """The user's optimizer, or a DistributedOptimizer with its class, groups and options."""
    target = optimizer_fn.func if isinstance(optimizer_fn, functools.partial) else optimizer_fn
    takes_params = inspect.isclass(target) and issubclass(target, torch.optim.Optimizer)
    made = optimizer_fn(holder.parameters() if takes_params else user_model)
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"optimizer_fn returned {type(made).__name__}, not a torch.optim.Optimizer")
    owned = {id(p) for p in holder.parameters()}
    groups = []
    for g in made.param_groups:
        params = [p for p in g["params"] if id(p) in owned]  # a pipeline stage holds a part
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    # (defaults may hold derived keys its constructor does not take: AdamW's decoupled_weight_decay)
    accepted = inspect.signature(type(made)).parameters
    options = {k: v for k, v in made.defaults.items() if k in accepted}
    if zero == 0:
        dropped = sum(len(g["params"]) for g in groups) != sum(len(g["params"]) for g in made.param_groups)
        return type(made)(groups, **options) if dropped else made
    return DistributedOptimizer(type(made), [ddp], zero_stage=zero, loss_scale=loss_scale, param_groups=groups,
                                **options)


class _Steps:
    """Where the accumulation window stands: micro-step ``micro`` of ``k``."""

    def __init__(self, k: int):
        self.k, self.micro = k, 0

    @property
    def last(self) -> bool:
        return self.micro == self.k - 1


# ---- what parallelize returns ----------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    """The identity whose backward multiplies the gradient (loss scaling, 1/k)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _call_args(batch: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A batch as the data loader gives it (a dict of keyword arguments, a tuple of
    positional ones, or one tensor), or the model's own arguments, as (args, kwargs)."""
    if batch is not None and not args and not kwargs:
        if isinstance(batch, dict):
            return (), dict(batch)
        return (tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)), {}
    return ((batch, *args) if batch is not None else args), kwargs


class ParallelModel(nn.Module):
    """The model ``vescale.parallelize`` returns: calls the parallel model with a batch
    and returns its output with the loss made global (see the module docstring)."""

    def __init__(self, inner: nn.Module, pipeline, ddp, mesh, dp_dim: str, steps: _Steps, scaler,
                 zero3: bool = False, zero_optimizer: DistributedOptimizer | None = None):
        super().__init__()
        self.module = inner
        self.pipeline, self.ddp, self.mesh = pipeline, ddp, mesh
        self._dp_group = mesh.get_group(dp_dim) if dp_dim in mesh.mesh_dim_names and mesh.size(dp_dim) > 1 else None
        self._dp_size = mesh.size(dp_dim) if self._dp_group is not None else 1
        self._steps, self._scaler = steps, scaler
        # A rank whose forward raised tells the others in the loss's all-reduce where they
        # reach it next on the DP group (ZeRO-3's forward all-gathers on it first) and
        # reading the outcome on the host costs no device sync (CPU).
        self._dp_loss = None if self._dp_group is None else DPLoss(
            self._dp_group, self._dp_size, mesh.get_local_rank(dp_dim),
            can_agree=not zero3 and mesh.device_type == "cpu")
        if self._dp_loss is not None or pipeline is not None:
            keep_losses_eager()  # a compiled forward's loss must keep what it divides by (_compile.py)
        self._returns_loss: bool | None = None  # (unknown before the first call)
        self._zero3 = zero3
        self._zero_optimizer = zero_optimizer  # its masters follow load_state_dict

    def __deepcopy__(self, memo):
        raise TypeError(
            "copy.deepcopy of the model vescale.parallelize returned (torch.optim.swa_utils.AveragedModel makes "
            "one) is not supported: its process groups, gradient hooks and ZeRO / pipeline bookkeeping belong to "
            "this model, and a copy would run them on this model's parameters. For an EMA of the weights, keep "
            "averaged copies of the parameters: ema = [p.detach().clone() for p in model.parameters()], then "
            "e.lerp_(p.detach(), 1 - decay) after each step (DTensors included; under ZeRO-3 inside `with "
            "optimizer.full_parameters():`, on every DP rank); to evaluate with them, copy them into the "
            "parameters and back inside the same context (edits there are kept). copy.deepcopy(model.state_dict()) "
            "works where model.state_dict() does")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``nn.Module.zero_grad``, and ZeRO-2/3's reduced gradient slices too (``DDP.zero_grad``);
        inside the plan's accumulation window a no-op, as the optimizer's zero_grad is: the
        loop calls it every micro-step and the gradients add up until the window's step."""
        if self._steps.micro != 0:
            return
        super().zero_grad(set_to_none)
        if self.ddp is not None:
            self.ddp.zero_grad(set_to_none)

    def forward(self, batch: Any = None, *args, **kwargs):
        args, kwargs = _call_args(batch, args, kwargs)
        if self.pipeline is not None:
            return self._pipeline_step(args, kwargs)
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = self._steps.last
        rows = rows_of(args, kwargs)
        # without autograd (evaluation) the engine watches the forward for what a mean
        # cross-entropy divides by: the node that saves it in training is not made
        with items_seen(self._dp_loss is not None and not torch.is_grad_enabled()) as seen:
            try:
                out = self.module(*args, **kwargs)
                loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
            except Exception as error:
                if self._dp_loss is not None:
                    self._dp_loss.tell_others(error, rows, self._returns_loss)
                raise
            items = None if loss is None else items_averaged(loss, seen)
        self._returns_loss = loss is not None
        if loss is None or self._dp_loss is None and not torch.is_grad_enabled():
            return out
        if self._dp_loss is not None:
            # the weight innermost: in backward the loss scale multiplies first and the DP
            # share divides next, so an fp16 gradient overflows where one device's does (a
            # rank holding all of a short batch's rows weighs DP times its share)
            loss = self._dp_loss(loss, rows, items)
        return self._with_loss(out, self._for_backward(loss))

    @staticmethod
    def _with_loss(out, loss: torch.Tensor):
        if isinstance(out, torch.Tensor):
            return loss
        out.loss = loss
        return out

    def predict(self, batch: Any = None, *args, **kwargs):
        """The model's output for this rank's batch, as one device's call returns it, forward
        only and without gradients (call it under ``model.eval()`` for dropout's sake):
        through the pipeline's stages when there is one (on every rank of it), a plain call
        otherwise. Tensors come back whole and plain (DTensors gathered) either way."""
        args, kwargs = _call_args(batch, args, kwargs)
        if self.pipeline is not None:
            return self.pipeline.predict(*args, **kwargs)
        with torch.no_grad():
            return whole_output(self.module(*args, **kwargs))

    def _for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss whose gradient is over the accumulation steps and loss-scaled. With loss
        scaling, the gradient is over the DP ranks too, and DDP sums the shares
        (``ddp.as_shares``): the gradient of a rank's local mean is DP times one device's
        and overflowed fp16 inside the backward where one device's does not (set-up fuzzer,
        seed 14332; torch's DDP with a GradScaler does so). Without loss scaling DDP
        averages, as torch's does, so that a term added to the loss outside the model's
        output still gets the average its gradient needs."""
        factor = 1.0 / self._steps.k
        if self._scaler is not None:
            factor *= self._scaler.scale
            if self.ddp is not None:
                loss = as_shares(loss, [self.ddp])
        return _ScaleGrad.apply(loss, factor) if factor != 1.0 and loss.requires_grad else loss

    def _pipeline_step(self, args, kwargs) -> torch.Tensor:
        """Training (grad enabled, train mode): the schedule's forward and backward passes.
        Otherwise evaluation: its forward passes only, the loss and no gradients."""
        train = torch.is_grad_enabled() and self.training
        if self._dp_group is not None:
            self._check_even_rows(rows_of(args, kwargs))
        self.pipeline.global_loss = None
        loss = (self.pipeline.step if train else self.pipeline.evaluate)(*args, **kwargs)
        if self.pipeline.global_loss is not None:  # weighed by items over the replicas already
            loss = self.pipeline.global_loss
        elif self._dp_group is not None:
            dist.all_reduce(loss, group=self._dp_group)
            loss = loss / self._dp_size
        # training: gradients are in place already, backward() has nothing to do
        return loss.float().requires_grad_() if train else loss.float()

    def _check_even_rows(self, rows: int) -> None:
        """Under a pipeline, every DP rank must have as many rows as the others and at least
        one per micro-batch; decided on every rank alike (one rank raising alone would leave
        the others waiting in the schedule's collectives)."""
        bounds = torch.tensor([rows, -rows], dtype=torch.int64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self._dp_group)
        most, fewest = int(bounds[0]), -int(bounds[1])
        m = self.pipeline.schedule.microbatches
        if most != fewest or fewest < m:
            raise ValueError(
                f"under a pipeline, the DP ranks' batches must be even and hold at least one sample per "
                f"micro-batch ({m}); this step's have {fewest} to {most} rows (the last, smaller batch of a "
                f"drop_last=False loader?). Use data.drop_last=True, or a batch of {m} x DP samples or more "
                f"that divides by the DP degree")

    # The user's model's own views and names, under every plan (a DDP wrapper would prefix
    # them with "module.": a loop that picks parameters or loads a state by name would
    # find other names under DP than under TP or on one device). A pipeline stage lists
    # only the parameters it holds.
    @property
    def _user_model(self) -> nn.Module:
        return self.module.module if isinstance(self.module, DDP) else self.module

    def __getattr__(self, name: str):
        """The user's model's own attributes and methods (a Hugging Face model's ``generate``
        and ``config``), as torch's ``fully_shard`` leaves them on the model it returns;
        ``generate`` returns whole, plain tensors (as ``predict`` does)."""
        try:
            return super().__getattr__(name)  # (parameters, buffers and submodules of this wrapper)
        except AttributeError:
            if "module" not in self.__dict__.get("_modules", {}) or name.startswith("__"):
                raise
        if self.pipeline is not None:
            if name == "generate":
                raise AttributeError("generate through a pipeline is not supported (a rank holds only its stages' "
                                     "layers): generate under a plan without PP, or load "
                                     "vescale.checkpoint.full_state_dict(...) into a single-device model")
            return getattr(self.pipeline.module, name)
        found = getattr(self._user_model, name)
        if name == "generate":
            return functools.wraps(found)(lambda *args, **kwargs: whole_output(found(*args, **kwargs)))
        return found

    def parameters(self, recurse: bool = True):
        return self._user_model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._user_model.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        return self._user_model.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._user_model.named_buffers(prefix, recurse, remove_duplicate)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Into the user's model, by its own names (as ``state_dict`` gives them)."""
        self._whole_state_or_raise("model.load_state_dict()")
        result = self._user_model.load_state_dict(state_dict, strict=strict, assign=assign)
        if self._zero_optimizer is not None:  # its fp32 masters of bf16/fp16 parameters follow
            self._zero_optimizer.refresh_masters()
        return result

    def state_dict(self, *args, **kwargs):
        """The inner model's own: plain tensors, and DTensors that pickle whole. A pipeline
        rank holds only its stages (the others' parameters are meta) and ZeRO-3 empties its
        parameters between steps: there this raises, naming the ways to the whole state
        (a gather here would be a collective, and a loop that saves from rank 0 alone
        would hang in it)."""
        self._whole_state_or_raise("model.state_dict()")
        return self._user_model.state_dict(*args, **kwargs)

    def _whole_state_or_raise(self, call: str) -> None:
        if self.pipeline is None and not self._zero3:
            return
        what = "a pipeline rank holds only its stages' parameters" if self.pipeline is not None else \
            "ZeRO-3 keeps each rank's slices and empties the parameters between steps"
        raise RuntimeError(
            f"{call} cannot give one device's state here: {what}. On every rank, call "
            "vescale.checkpoint.full_state_dict(model, optimizer=optimizer.inner if ZeRO-3) for the whole "
            "state (plain tensors), vescale.checkpoint.export_torch(path, model, optimizer=...) for a "
            "single-device torch.save file, or vescale.save(path, {...}) for a checkpoint that resumes under "
            "any plan; model.module.state_dict() gives this rank's own parameters")


class ParallelOptimizer(torch.optim.Optimizer):
    """The optimizer ``vescale.parallelize`` returns: the plan's optimizer with gradient
    accumulation and clipping around its step; its groups and state are the inner one's
    (LR schedulers and logging see them)."""

    def __init__(self, inner: torch.optim.Optimizer, steps: _Steps, clip_norm: float | None, mesh, pp_dim: str,
                 parameters: Callable, pipeline=None, materialize: Callable | None = None):
        """``parameters()``: the model's (this rank's), which ``clip_norm`` clips, as a loop's
        ``clip_grad_norm_(model.parameters())`` does. ``materialize()``: gives a
        ``deferred_init`` model its values (``full_parameters`` does, before a script
        reads or edits them)."""
        # (groups, not a flat list: a stage or a script may give it none of the parameters
        # to step, which torch takes in empty groups and refuses in an empty list)
        super().__init__([{"params": list(g["params"])} for g in inner.param_groups], inner.defaults)
        self.inner, self._steps, self.clip_norm = inner, steps, clip_norm
        self._pipeline, self._parameters, self._materialize = pipeline, parameters, materialize
        pp_size = mesh.size(pp_dim) if pp_dim in mesh.mesh_dim_names else 1
        # what clips: ZeRO's optimizer over its slices (every DDP parameter's, those in no
        # group too), else the global norm of the .grad's
        self._clipper = inner if isinstance(inner, DistributedOptimizer) else GlobalClip(parameters, pp_size, pipeline)
        self.param_groups = inner.param_groups  # the inner optimizer's own, as DistributedOptimizer does
        self.state = inner.state

    def add_param_group(self, param_group: dict) -> None:
        """Into the inner optimizer (ZeRO's steps them through its master slices), with the
        parameters this rank holds (a pipeline stage holds a part)."""
        if presenting_groups(self):
            return super().add_param_group(param_group)
        held = {id(p) for p in self._parameters()}
        self.inner.add_param_group({**param_group, "params": [p for p in group_params(param_group) if id(p) in held]})

    def clips(self, model: nn.Module) -> None:
        """torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on ``model``'s parameters clip
        through this optimizer (``parallel/torch_clip.py``): by the global norm."""
        torch_clip.register(self, model.parameters)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler then sets grad_scale / found_inf and calls step(), which
        # refuses it where its per-rank inf check cannot see one device's: ZeRO's slices,
        # a pipeline rank's stages (see refuse_grad_scaler)
        return isinstance(self.inner, DistributedOptimizer) or self._pipeline is not None

    def full_parameters(self):
        """A context in which ZeRO-3's parameters are whole, to read or edit them between
        steps (they are empty there; edits are kept); a no-op under the other plans. Every
        DP rank enters it. A ``deferred_init`` model gets its values here first (they are
        made at the first step otherwise, and an edit of the meta tensors before would be
        lost: it raises)."""
        if self._materialize is not None:
            self._materialize()
        if isinstance(self.inner, DistributedOptimizer):
            return self.inner.full_parameters()
        return contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._steps.micro == 0:  # inside an accumulation window the gradients add up
            self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        refuse_grad_scaler(self)
        if not self._steps.last:
            self._steps.micro += 1
            return None
        self._steps.micro = 0
        if self.clip_norm is not None:
            self.clip_grad_norm_(self.clip_norm)
        return self.inner.step(closure)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the global gradient norm over every rank (every stage of a pipeline,
        elements a mesh replicates counted once); returns the norm."""
        return self._clipper.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamps every gradient element to [-clip_value, clip_value], as torch's does."""
        self._clipper.clip_grad_value_(clip_value)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ParallelOptimizer({self.inner!r})"
