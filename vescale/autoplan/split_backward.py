"""What the zero-bubble schedules' split backward keeps between its two halves.

A zero-bubble schedule (ZB-H1, ZB-V) runs a micro-batch's backward in two actions: I, the
gradients of the stage's input, and later W, the parameters' gradients. torch's split
(``torch.distributed.pipelining._backward``, which vescale's pipeline engine runs) keeps,
from I to W, the gradient arriving at every autograd node where a parameter's path meets
the input's (the output of each linear layer, norm, embedding lookup): for a GPT block
about 0.7x its saved activations, held on top of them. The
planner reads the bytes from one such I on the model as it will run (this rank's shards).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .._local import local_of
from ..parallel.pipeline.split import Layout
from .calling import call_model, loss_of, slice_batch
from .structure import storage_key

__all__ = ["held_for_weights", "sharded_held_for_weights"]


def held_for_weights(model: nn.Module, layout: Layout, batch, loss_fn=None) -> dict[str, int]:
    """Bytes per unit that a split backward keeps from I to W for one micro-batch of
    ``batch`` (storages counted once, a DTensor's local shard), attributed to the unit
    whose parameters will take them. Block 0's input is made a leaf, as a later stage's
    received input is; the units before it run their whole backward in I (vescale's first
    stage does) and keep nothing. The parameters' gradients are left as they were."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input

    leaves: list[torch.Tensor] = []

    def as_leaves(mod, args, kwargs):
        def leaf(x):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x = x.detach().requires_grad_()
                leaves.append(x)
            return x
        return tree_map(leaf, args), tree_map(leaf, kwargs)

    first = layout.blocks[0].module if layout.blocks else None
    if first is None:
        return {}
    before = {id(p): p.grad for p in model.parameters()}
    handle = first.register_forward_pre_hook(as_leaves, with_kwargs=True)
    try:
        loss = loss_of(call_model(model, batch), loss_fn)
    finally:
        handle.remove()
    if not leaves:
        return {}
    owner = {}
    for u in layout.units:  # a tied parameter goes with the last unit that holds it (the head's W takes it)
        for p in u.module.parameters():
            if p.requires_grad:
                owner[_get_grad_fn_or_grad_acc(p)] = u.name
    params = [p for p in model.parameters() if p.requires_grad]
    _, groups = stage_backward_input([loss], None, leaves, iter(params))
    held: dict[str, int] = defaultdict(int)
    seen: set = set()
    for g in groups:
        unit = next((owner[n] for n in g["params"] if n in owner), None)
        for t in tree_flatten(g.get("grads") or [])[0]:
            if unit is None or not isinstance(t, torch.Tensor):
                continue
            st = local_of(t).untyped_storage()
            if storage_key(st) not in seen:
                seen.add(storage_key(st))
                held[unit] += st.nbytes()
    del groups, loss
    for p in model.parameters():
        p.grad = before.get(id(p))
    return dict(held)


def sharded_held_for_weights(profile, model: nn.Module, batch, plan: dict, tp: int, *, real: bool = False) -> dict:
    """``held_for_weights`` on one TP rank under ``plan``: a what-if run over a virtual TP
    mesh (on meta, or on real local tensors: ``real``) at the profile's smaller batch size.
    Returns its per-sample line per unit, {unit: (0, bytes per sample)} ({} where torch's
    split cannot take the model apart)."""
    from ..parallel.parallelize import parallelize_module
    from ..parallel.pipeline.split import find_layout
    from .scalars import replaying
    from .virtual import VirtualMesh, what_if_batch, what_if_copy, what_if_run

    n = profile.measured_at[0]
    copied = what_if_copy(model, real)
    try:
        with replaying(profile.scalars), what_if_run(real):
            parallelize_module(copied, VirtualMesh([tp], ["TP"]), plan)
            held = held_for_weights(copied, find_layout(copied, profile.blocks),
                                    what_if_batch(slice_batch(batch, n), real))
    except RuntimeError:
        return {}
    return {name: (0.0, b / n) for name, b in held.items()}
