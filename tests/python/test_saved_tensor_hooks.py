"""Collectives under saved-tensor hooks: non-reentrant activation checkpointing
(``torch.utils.checkpoint``, ``recompute.modules`` in a plan), ``save_on_cpu`` and the
user's own ``saved_tensors_hooks`` put Python objects in the thread's autograd state,
which gloo's worker thread copies when it runs a collective (taking the GIL). A
collective that an op reached with the GIL held (indexing does not release it) then
deadlocked: found by the set-up fuzzer (a Llama under TP4 recomputing its first layer
hung in its rotary embedding's slice). Each case is checked against plain tensors."""

import torch
from torch.utils.checkpoint import checkpoint

import vescale
from vescale import Shard

from dist_utils import make_dtensor, mesh, mismatch, rand


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x: torch.Tensor) -> torch.Tensor:
    return (x * 0.5 + _rotate_half(x) * 2.0).sin().sum()


def _case_hooks(mesh_name: str, how: str) -> list[str]:
    m = mesh(mesh_name)
    full = rand((3, 10), seed=4)
    placements = [Shard(1)] * m.ndim  # the sliced dim is split: every slice gathers
    x = make_dtensor(full, m, placements, requires_grad=True)
    plain = full.clone().requires_grad_()
    packed = []

    def run(t):
        if how == "checkpoint":
            return checkpoint(_rotary, t, use_reentrant=False)
        if how == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return _rotary(t)
        with torch.autograd.graph.saved_tensors_hooks(lambda s: packed.append(1) or s, lambda s: s):
            return _rotary(t)

    got, want = run(x), run(plain)
    got.backward()
    want.backward()
    failures = []
    for what, a, b in (("value", got.full_tensor(), want.detach()), ("gradient", x.grad.full_tensor(), plain.grad)):
        err = mismatch(a, b, rtol=1e-12, atol=1e-12)
        if err:
            failures.append(f"{how} {what}: {err}")
    if how == "hooks" and not packed:
        failures.append("the user's pack hook never ran")
    return failures


def test_collectives_inside_saved_tensor_hooks(pool4):
    for mesh_name in ("1d4", "2d"):
        for how in ("checkpoint", "save_on_cpu", "hooks"):
            for failures in pool4.run(_case_hooks, mesh_name, how):
                assert failures == [], (mesh_name, how)
