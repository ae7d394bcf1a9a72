"""One rank of a job that test_faults.py starts with torchrun's environment variables:
a tiny Llama on a 2x2 (DP x TP) mesh with ZeRO-2, trained for a few steps, saved and
loaded, while one rank (the victim) fails at a chosen point.

    python fault_worker.py POINT HOW VICTIM CKPT_DIR

POINT: forward | backward | step | save | load | none
HOW:   kill  (SIGKILL: the process vanishes)
       raise (the victim raises, catches it and goes on to a different collective)
POINT diverge: no training; the victim's tensor has a data-dependent number of rows, so
       its all-reduce differs from its TP partner's (run with VESCALE_DEBUG=1)
POINT finalist: no training; the planner trains its finalists and the victim's first
       optimizer step raises (as running out of memory on the fullest stage would)

Every rank writes "vescale-fault-test: rank R <event> at T" lines to stderr (T: wall clock),
so the test can measure how long the others took to fail after the victim did.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import vescale
from vescale.parallel import DDP, DistributedOptimizer, parallelize_module
from vescale.parallel.plans import llama_plan
from examples.models.llama import LlamaConfig, LlamaForCausalLM

WORLD = 4
STEPS = 3
FAIL_AT_STEP = 1  # fail in the second step, with every collective already set up


def log(event: str) -> None:
    print(f"vescale-fault-test: rank {dist.get_rank()} {event} at {time.time():.3f}", file=sys.stderr, flush=True)


def diverge(mesh, victim: int) -> None:
    rows = 6 if dist.get_rank() == victim else 4  # e.g. the tokens a filter kept on this rank
    partial = vescale.DTensor.from_local(torch.ones(rows, 4), mesh["TP"], [vescale.Partial()])
    log("redistributes")
    partial.redistribute(mesh["TP"], [vescale.Replicate()]).to_local().sum()
    log("finished")


def failing_finalist(victim: int) -> None:
    import vescale.autoplan.trials as trials
    from vescale.autoplan import plan_eager
    from autoplan_models import COMM, gpt, tokens

    real_train, real_step = trials._train, torch.optim.AdamW.step

    def train(*args, **kwargs):  # a finalist's training: its optimizer (AdamW) fails on the victim
        torch.optim.AdamW.step = step
        try:
            return real_train(*args, **kwargs)
        finally:
            torch.optim.AdamW.step = real_step

    def step(self, *args, **kwargs):
        if dist.get_rank() == victim:
            log("fails in finalist")
            raise RuntimeError("injected failure in a finalist")
        return real_step(self, *args, **kwargs)

    trials._train = train
    plan_eager(gpt(), tokens(), world=WORLD, steps=1, tp_degrees=[1], comm=COMM, trials=2)
    log("finished")


def main(point: str, how: str, victim: int, ckpt: str) -> None:
    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    rank = dist.get_rank()
    if point == "diverge":
        return diverge(mesh, victim)
    if point == "finalist":
        return failing_finalist(victim)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
    parallelize_module(model, mesh["TP"], llama_plan(sequence_parallel=True))
    model = DDP(model, mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], zero_stage=2, lr=1e-2)
    state = {"model": model, "optimizer": opt}
    step = 0

    class Injected(RuntimeError):
        pass

    def fail(where: str) -> None:
        if rank != victim or where != point or step != FAIL_AT_STEP:
            return
        log(f"fails in {where}")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise Injected(f"injected failure in {where}")

    layer = model.module.model.layers[1]
    layer.register_forward_pre_hook(lambda mod, args: fail("forward"))
    layer.register_full_backward_pre_hook(lambda mod, grad: fail("backward"))
    inner_step = opt.inner.step

    def step_then_fail(*args, **kwargs):  # before the all-gather of the updated slices
        inner_step(*args, **kwargs)
        fail("step")

    opt.inner.step = step_then_fail
    import vescale.checkpoint.loading as loading
    import vescale.checkpoint.writing as writing

    real_write = writing.write_file

    def write_then_fail(file, chunks):
        records = real_write(file, chunks)
        fail("save")
        return records

    writing.write_file = write_then_fail
    real_check = loading._check

    def check_then_fail(*args):
        real_check(*args)
        fail("load")

    loading._check = check_then_fail

    g = torch.Generator().manual_seed(7)
    dp_rank = mesh.get_local_rank("DP")
    log("started")
    try:
        for step in range(STEPS):
            data = torch.randint(0, 64, (4, 17), generator=g)
            rows = slice(2 * dp_rank, 2 * dp_rank + 2)
            opt.zero_grad()
            loss = model(data[rows, :-1], data[rows, 1:])
            loss.backward()
            opt.step()
            vescale.save(ckpt, state)
            vescale.load(ckpt, state)  # load has no collectives: the next step's are the first to miss the victim
    except Injected:
        log("raised and goes on to a barrier")
        dist.barrier()  # a different collective than the others are in
    log("finished")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
