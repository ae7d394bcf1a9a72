"""The aten ops that training steps of the test models dispatch, and which of them
have a vescale sharding rule.

    .venv/bin/python -m tests.opinfo.training_ops          # prints a markdown table

Ops are recorded with a TorchDispatchMode on a plain single-device step (forward,
backward, AdamW): that mode sits below autograd, where vescale's handler sits, so it
sees the same ops (composite ops already decomposed, CompositeExplicit ones whole).
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import LlamaConfig, LlamaForCausalLM

MODELS = {
    "gpt": lambda: GPT(GPTConfig(dropout=0.1)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig()),
}

# Ops that never carry a DTensor, so they never reach vescale: the AdamW step counter
# is a plain scalar tensor (read with item()), and lift_fresh only wraps constants
# made from Python numbers. Ops without any tensor argument (arange, ones, profiler
# markers) are left out as they are recorded.
PLAIN_ONLY = {"aten::_local_scalar_dense", "aten::lift_fresh"}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, torch.Tensor) for a in flat):
            self.ops.add(str(func._schema.name) + ("." + func._overloadname if func._overloadname != "default" else ""))
        return func(*args, **(kwargs or {}))


def training_ops(name: str, foreach: bool = False) -> set[str]:
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    idx = torch.randint(0, 64, (2, 16))
    recorder = _Recorder()
    with recorder:
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
    return recorder.ops - PLAIN_ONLY


def coverage(ops: set[str]) -> tuple[list[str], list[str]]:
    import vescale

    ruled = set(vescale._C.rule_names())
    return sorted(ops & ruled), sorted(ops - ruled)


def main() -> int:
    for name in MODELS:
        for foreach in (False, True):
            ops = training_ops(name, foreach)
            ruled, missing = coverage(ops)
            share = len(ruled) / len(ops)
            print(f"### {name} (AdamW foreach={foreach}): {len(ruled)}/{len(ops)} ops have a rule ({share:.0%})")
            print("without a rule: " + (", ".join(f"`{op}`" for op in missing) or "none"))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
