"""A model's structure from one untimed eager step: its linear layers (what tensor
parallelism can split), the module order, the aten ops and FLOPs of each unit, the bytes
each unit saves for backward, the legal pipeline cuts and the linear outputs the model
splits into equal pieces at once (fused q|k|v, gate|up)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ..parallel.pipeline.split import Layout
from .calling import call_model, loss_of

__all__ = ["Linear", "signature", "linears_of", "storage_key", "untimed_step"]


@dataclass
class Linear:
    """A module with one 2-d weight the tensor-parallel what-if can split."""

    name: str            # FQN of the module
    weight: str          # FQN of its weight
    bias: str | None
    shape: tuple         # the weight's shape
    out_dim: int         # the weight dim that indexes output features (0 for nn.Linear, 1 for Conv1D)
    fused: int = 1       # k > 1: the model splits its output into k equal pieces at once
    embedding: bool = False  # an nn.Embedding (the dim that indexes rows is the vocabulary)


def signature(module: nn.Module) -> tuple:
    return (type(module).__name__,) + tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


def linears_of(model: nn.Module) -> list[Linear]:
    out = []
    for name, m in model.named_modules():
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if w is None or w.dim() != 2:
            continue
        b = m._parameters.get("bias")
        if isinstance(m, nn.Embedding):
            out.append(Linear(name, f"{name}.weight", None, tuple(w.shape), 0, embedding=True))
            continue
        if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            out_dim = 1
        elif isinstance(m, nn.Linear):
            out_dim = 0
        elif b is not None and b.dim() == 1 and b.shape[0] in w.shape:
            out_dim = list(w.shape).index(b.shape[0])
        else:
            out_dim = 0
        out.append(Linear(name, f"{name}.weight", f"{name}.bias" if b is not None else None, tuple(w.shape), out_dim))
    return out


_SPLITS = {"aten::split.Tensor", "aten::split_with_sizes", "aten::unbind.int", "aten::chunk",
           "aten::unsafe_split.Tensor", "aten::unsafe_split_with_sizes"}


class _OpRecorder(TorchDispatchMode):
    """Counts the aten ops each module's forward runs (innermost module), the backward's in
    all, and notices outputs of linear layers split into equal pieces along the last dim."""

    def __init__(self, stack: list, linear_outputs: dict):
        super().__init__()
        self.stack, self.linear_outputs = stack, linear_outputs
        self.forward_ops: dict[str, Counter] = defaultdict(Counter)
        self.backward_ops: Counter = Counter()
        self.in_backward = False
        self.fused: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
        if self.in_backward:
            self.backward_ops[name] += 1
        else:
            self.forward_ops[self.stack[-1] if self.stack else ""][name] += 1
        out = func(*args, **kwargs)
        if name in _SPLITS and args and isinstance(args[0], torch.Tensor):
            owner = self.linear_outputs.get(id(args[0]))
            if owner is not None and isinstance(out, (tuple, list)) and len(out) > 1:
                x = args[0]
                dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) if name != "aten::unbind.int" else None
                if dim is not None and dim % x.dim() == x.dim() - 1 and len({o.shape[-1] for o in out}) == 1:
                    self.fused[owner] = len(out)
        return out


def storage_key(st) -> int:
    """One storage, however many tensors view it: its address, or on ``meta`` (where every
    storage's address is 0) the storage object's own."""
    return st.data_ptr() or st._cdata


def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# kernels torch's FLOP counter does not know (it would count the CPU's fused attention as 0)
_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def untimed_step(model: nn.Module, layout: Layout, batch, loss_fn, linears: list[Linear]):
    """One untimed step: module order and depth, ops, FLOPs per unit, saved bytes per unit,
    what crosses each block boundary, fused linear outputs."""
    names = {m: n for n, m in model.named_modules()}
    param_storages = {storage_key(p.untyped_storage()) for p in list(model.parameters()) + list(model.buffers())}
    order: dict[str, tuple] = {}
    stack: list[str] = []
    unit_of = {u.module: u.name for u in layout.units}
    current_unit: list[str] = []
    saved: dict[str, int] = defaultdict(int)
    seen_storages: set = set()
    linear_names = {lin.name for lin in linears if not lin.embedding}
    linear_outputs: dict[int, str] = {}
    block_inputs: dict[int, list] = {}
    block_outputs: dict[int, list] = {}
    handles = []

    def pre(mod, args, kwargs):
        n = names.get(mod, "?")
        order.setdefault(n, (len(order), n.count(".") + 1 if n else 0, type(mod).__name__))
        stack.append(n)
        if mod in unit_of:
            current_unit.append(unit_of[mod])
        u = next((x for x in layout.blocks if x.module is mod), None)
        if u is not None and u.block not in block_inputs:
            block_inputs[u.block] = [(k, v) for k, v in list(enumerate(args)) + list(kwargs.items())]

    def post(mod, args, kwargs, out):
        n = stack.pop() if stack else ""
        if mod in unit_of and current_unit:
            last_unit[0] = current_unit.pop()
        if n in linear_names and isinstance(out, torch.Tensor):
            linear_outputs[id(out)] = n
        u = next((x for x in layout.blocks if x.module is mod), None)
        if u is not None and u.block not in block_outputs:
            block_outputs[u.block] = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))

    last_unit = [layout.units[0].name if layout.units else ""]

    def pack(t):
        st = t.untyped_storage()
        ptr = storage_key(st)
        if ptr not in param_storages and ptr not in seen_storages and not recorder.in_backward:
            seen_storages.add(ptr)
            # glue before the first unit counts with it, glue after a unit (the loss) with that unit
            owner = current_unit[-1] if current_unit else last_unit[0]
            saved[owner] += st.nbytes()
        return t

    recorder = _OpRecorder(stack, linear_outputs)
    flops = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    try:
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with flops:  # forward FLOPs only
                loss = loss_of(call_model(model, batch), loss_fn)
            recorder.in_backward = True
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    counts = flops.get_flop_counts()
    root = type(model).__name__
    unit_flops = {}
    for u in layout.units:
        key = f"{root}.{u.name}"
        unit_flops[u.name] = float(sum(counts.get(key, {}).values()))
    for lin in linears:
        lin.fused = recorder.fused.get(lin.name, 1)
    # ops per unit (its own forward and its submodules')
    unit_ops = {}
    for u in layout.units:
        c = Counter()
        for mod_name, ops in recorder.forward_ops.items():
            if mod_name == u.name or mod_name.startswith(u.name + "."):
                c.update(ops)
        unit_ops[u.name] = dict(c)
    # cuts: what block i receives that needs a gradient must be block i-1's output
    problems: list[str] = []
    side: dict[int, list[str]] = {}
    for i in range(len(layout.blocks)):
        ins = block_inputs.get(i, [])
        side[i] = [str(k) for k, v in ins if isinstance(v, torch.Tensor) and not v.requires_grad]
        if i == 0:
            continue
        prev = {id(t) for t in block_outputs.get(i - 1, [])}
        bad = [str(k) for k, v in ins for t in tree_flatten(v)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in prev]
        problems.append(f"it takes {bad} that need gradients and are not block {i - 1}'s output" if bad else "")
    modules = [(n, depth, cls) for n, (_, depth, cls) in sorted(order.items(), key=lambda kv: kv[1][0])]
    return dict(modules=modules, flops=unit_flops, saved=dict(saved), ops=unit_ops,
                backward_ops=dict(recorder.backward_ops), cut_problems=problems, side=side)
