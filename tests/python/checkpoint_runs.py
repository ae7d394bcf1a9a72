"""What the checkpoint tests (test_checkpoint.py, test_checkpoint_faults.py,
test_checkpoint_interop.py) share: a small GPT trained on a layout of
test_parallel.LAYOUTS (``_Run``), its global batches, and the world size of each mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist

import vescale
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module

from dist_utils import mesh
from test_parallel import LAYOUTS
from examples.models.gpt import GPT, GPTConfig
from vescale.parallel.plans import gpt_plan

# vocab 66 and 6 heads of 6: TP4 splits the vocabulary 17/17/17/15 (uneven shards)
CONFIG = dict(vocab_size=66, n_embd=36, n_head=6, bias=False)
GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 4, 3, 3
WORLD = {"1d2": 2, "1d4": 4, "2d": 4}


def _batches():
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, 17), generator=g)
            for _ in range(STEPS_BEFORE + STEPS_AFTER)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _optimizer(params_or_models, zero: int):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    if zero:
        return DistributedOptimizer(torch.optim.AdamW, models=params_or_models, zero_stage=zero, **kwargs)
    return torch.optim.AdamW(params_or_models, **kwargs)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


class _Run:
    """One layout of test_parallel.LAYOUTS: model, optimizer, scheduler, this rank's rows."""

    def __init__(self, layout: str, seed: int):
        mesh_name, tp_dim, dp_dim, sp, zero = LAYOUTS[layout]
        m = mesh(mesh_name)
        tp = None if tp_dim is None else (m[tp_dim] if isinstance(tp_dim, str) else m)
        self.dp = None if dp_dim is None else (m[dp_dim] if isinstance(dp_dim, str) else m)
        torch.manual_seed(seed)
        model = GPT(GPTConfig(**CONFIG))
        if tp is not None:
            parallelize_module(model, tp, gpt_plan(sequence_parallel=sp))
        self.model = DDP(model, self.dp) if self.dp is not None else model
        self.zero = zero
        self.opt = _optimizer([self.model] if zero else self.model.parameters(), zero)
        self.sched = _schedule(self.opt)
        size, rank = (self.dp.size(), self.dp.get_local_rank()) if self.dp is not None else (1, 0)
        local = GLOBAL_BATCH // size
        self.rows = slice(rank * local, (rank + 1) * local)

    def state(self) -> dict:
        return {"model": self.model, "optimizer": self.opt, "lr_scheduler": self.sched}

    def train(self, batches) -> list[float]:
        losses = []
        for idx, tgt in batches:
            self.opt.zero_grad()
            loss = self.model(idx[self.rows], tgt[self.rows])
            loss.backward()
            self.opt.step()
            self.sched.step()
            value = loss.full_tensor() if isinstance(loss, vescale.DTensor) else loss.detach().clone()
            if self.dp is not None:
                dist.all_reduce(value, group=self.dp.get_group())
                value /= self.dp.size()
            losses.append(value.item())
        return losses

    def full_parameters(self) -> dict[str, torch.Tensor]:
        inner = self.model.module if isinstance(self.model, DDP) else self.model
        with self.opt.full_parameters() if self.zero else torch.no_grad():
            # full_tensor() of a replicated DTensor is its local tensor: copy, since training goes on
            return {n: (p.full_tensor() if isinstance(p, vescale.DTensor) else p.detach()).clone()
                    for n, p in inner.named_parameters()}
