"""Per-block costs for the cost-balanced split methods.

- ``"parameters"``: parameter counts (no sample needed).
- ``"flops"``: forward FLOPs of each unit, counted by torch's FlopCounterMode while the
  model runs once on ``meta`` tensors (no memory, no real compute); forward + backward is
  taken as 3x the forward (backward computes two products per forward product).
- ``"time"``: measured. The model runs once on meta to capture what each unit receives;
  then each unit alone is copied, given random weights and timed (forward + backward,
  median of 3 after a warm-up) on random inputs of those shapes, so at most one unit is
  ever materialised. The bytes it saves for backward are recorded too. Timings differ
  between ranks, so the ranks average them (one all-reduce) and cut alike.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from .split import Layout, PipelineSplitError

LAST_PROFILE: dict = {}  # name -> {"cost": ..., "saved_bytes": ...} of the latest "time" profile


def block_costs(model: nn.Module, layout: Layout, method: str, sample) -> tuple[list[float], float, float]:
    """(cost of each block, cost of the first stage's other units, of the last stage's)."""
    if method == "parameters":
        per = {u.name: float(sum(p.numel() for p in u.module.parameters())) for u in layout.units}
    else:
        if sample is None:
            raise PipelineSplitError(f"split={method!r} measures the model on a sample micro-batch: pass "
                                     f"sample=(args, kwargs), e.g. sample=((input_ids,), {{}})")
        args, kwargs = sample
        flops, inputs = _meta_run(model, layout, args, kwargs)
        per = {n: 3.0 * f for n, f in flops.items()} if method == "flops" else _timed(layout, inputs)
    return ([per.get(u.name, 0.0) for u in layout.blocks], sum(per.get(u.name, 0.0) for u in layout.pre),
            sum(per.get(u.name, 0.0) for u in layout.post))


def _meta_run(model, layout: Layout, args, kwargs) -> tuple[dict, dict]:
    """One forward on meta: forward FLOPs per unit and the (args, kwargs) each received."""
    state = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        m = torch.empty(t.shape, dtype=t.dtype, device="meta")
        state[name] = m.requires_grad_(t.requires_grad)
    flops: dict[str, float] = {}
    inputs: dict[str, tuple] = {}
    counter = FlopCounterMode(display=False)
    handles = []
    for unit in layout.units:
        def pre(module, a, k, unit=unit):
            if unit.name not in inputs:  # as they are now: later units fill a KV cache the model passes along
                inputs[unit.name] = _copied((a, k))
            flops[unit.name] = flops.get(unit.name, 0.0) - counter.get_total_flops()

        def post(module, a, k, out, unit=unit):
            flops[unit.name] += counter.get_total_flops()
        handles.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(unit.module.register_forward_hook(post, with_kwargs=True))
    try:
        with counter, _MetaScalarsAreZero(), torch.no_grad():
            torch.func.functional_call(model, state, tree_map(_meta, tuple(args)), tree_map(_meta, dict(kwargs)),
                                       tie_weights=True, strict=False)
    except Exception as e:  # noqa: BLE001  (re-raised with the way out)
        raise PipelineSplitError(f"the model cannot run on meta tensors to be profiled ({type(e).__name__}: {e}); "
                                 f"use split='parameters', 'uniform' or explicit split points") from e
    finally:
        for h in handles:
            h.remove()
    return flops, inputs


class _MetaScalarsAreZero(TorchDispatchMode):
    """A value read from a meta tensor (``.item()``, ``if t:``) is zero while the model is
    profiled. Models check their inputs with such reads (transformers looks for padding
    tokens in ``input_ids``), which have no values on meta; only shapes matter for the
    costs, and a check's answer at most picks another branch of similar cost."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def _meta(x):
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _copied(inputs):
    """A copy of a unit's inputs that the unit may change (a Hugging Face model passes a
    KV cache, which each layer extends); the inputs themselves where they cannot be copied."""
    try:
        return copy.deepcopy(inputs)
    except Exception:  # noqa: BLE001  (an object that refuses copying: used as it is)
        return inputs


def _real(x):
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        return torch.randn(x.shape, dtype=x.dtype).requires_grad_()
    if x.dtype == torch.bool:
        return torch.ones(x.shape, dtype=torch.bool)
    return torch.zeros(x.shape, dtype=x.dtype)


def _timed(layout: Layout, inputs: dict) -> dict[str, float]:
    LAST_PROFILE.clear()
    names = [u.name for u in layout.units]
    seconds = []
    for unit in layout.units:
        if unit.name not in inputs:
            seconds.append(0.0)
            continue
        module = copy.deepcopy(unit.module).to_empty(device="cpu")
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.02)
            # buffers keep their values where there are any (BERT's position and token-type
            # ids index its embeddings: left empty, they held garbage indices)
            for b, original in zip(module.buffers(), unit.module.buffers()):
                b.zero_() if original.is_meta else b.copy_(original)
        a, k = inputs[unit.name]
        runs, saved = [], 0
        for i in range(4):
            a_real, k_real = tree_map(_real, _copied((a, k)))  # (each run fills its own cache)
            sizes: dict[int, int] = {}

            def pack(t):
                sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = module(*a_real, **k_real)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            if i:
                runs.append(time.perf_counter() - start)
            saved = sum(sizes.values())
        seconds.append(statistics.median(runs))
        LAST_PROFILE[unit.name] = {"seconds": seconds[-1], "saved_bytes": saved}
        del module
    total = torch.tensor(seconds, dtype=torch.float64)
    if dist.is_initialized():  # every rank must cut alike: average the ranks' timings
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return dict(zip(names, total.tolist()))
