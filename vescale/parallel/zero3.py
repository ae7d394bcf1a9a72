"""ZeRO-3: parameters live as this rank's DP slice and are whole only while a module
that owns them runs.

Each parameter's local tensor (a DTensor's shard or a plain tensor) keeps its
storage object, emptied between uses: just before a module's forward, and again
before its backward, the slices are all-gathered back into that storage; after the
forward, and once backward has produced every gradient of the module's parameters,
the storage is emptied again. Autograd's saved references see the data again because
the storage object is the same, and the writes go to the storage directly, so no
version counter moves (which autograd would report as an in-place modification).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .ddp import Slot, local_of

__all__ = ["ShardedParameters"]

# The first module of a model (an embedding of integer ids) takes no input that requires
# grad; its backward pre-hook still fires, at its output, which is all this needs.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to "
                        "module outputs since no inputs require gradients")


@dataclass
class _Sharded:
    param: nn.Parameter
    slot: Slot
    start: int
    end: int
    slice: torch.Tensor  # this rank's elements, in the parameter's dtype


class ShardedParameters:
    def __init__(self, modules: list[nn.Module], slots: list[tuple[Slot, int, int]], group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.sharded: dict[int, _Sharded] = {}
        for slot, start, end in slots:
            flat = local_of(slot.param).detach().reshape(-1)
            self.sharded[id(slot.param)] = _Sharded(slot.param, slot, start, end, flat[start:end].clone())
        self._hooked: list = []
        for root in modules:
            for module in root.modules():
                owned = [p for p in module._parameters.values() if p is not None and id(p) in self.sharded]
                if owned:
                    self._hook(module, owned)
        self.release(list(self.sharded.values()))

    def slice_of(self, param: nn.Parameter) -> torch.Tensor:
        return self.sharded[id(param)].slice

    @contextlib.contextmanager
    def whole(self):
        """Every parameter whole for the duration (to read, save or evaluate them);
        outside forward and backward their storage is empty and must not be read."""
        entries = list(self.sharded.values())
        self.gather(entries)
        try:
            yield
        finally:
            self.release(entries)

    # ---- gather and release ----

    def gather(self, entries: list[_Sharded]) -> None:
        for e in entries:
            local = local_of(e.param)
            storage = local.untyped_storage()
            if storage.nbytes() > 0:
                continue  # whole already (a tied parameter another module gathered)
            padded = torch.zeros(e.slot.chunk, dtype=local.dtype, device=local.device)
            padded[: e.end - e.start].copy_(e.slice)
            whole = torch.empty(self.world * e.slot.chunk, dtype=local.dtype, device=local.device)
            _all_gather(whole, padded, self.group)
            exact = whole[: local.numel()].clone()  # a storage of exactly the parameter's size
            storage.resize_(exact.untyped_storage().nbytes())
            storage.copy_(exact.untyped_storage())

    def release(self, entries: list[_Sharded]) -> None:
        for e in entries:
            local_of(e.param).untyped_storage().resize_(0)

    # ---- module hooks ----

    def _hook(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        entries = [self.sharded[id(p)] for p in params]
        waiting = {"count": 0}

        def before_forward(mod, args):
            self.gather(entries)

        def after_forward(mod, args, output):
            self.release(entries)

        def before_backward(mod, grad_output):
            waiting["count"] = len(entries)
            self.gather(entries)

        def grad_ready(param):
            waiting["count"] -= 1
            if waiting["count"] == 0:
                self.release(entries)

        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)
        module.register_full_backward_pre_hook(before_backward)
        for p in params:
            p.register_post_accumulate_grad_hook(grad_ready)


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    # torch 2.13 renames all_gather_into_tensor to all_gather_single; 2.11 has only the former.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)
