"""The pipeline runtime's own processor time per schedule action, measured on the ranks at
hand.

A stage's forward or backward costs more than its units' compute: the runner's Python, the
activation's receive and send (gloo's threads included), the autograd call. On 4 gloo
ranks sharing 2 cores it came to about 2 ms of processor time per action (the GPT of
bench/autoplan.py, PP2 DP2: interleaved m4 v2 against 1f1b m4, twice the actions, 68 ms
more processor time over the 4 ranks), which makes schedules with many actions (virtual
stages, many micro-batches) slower than their units say.

``action_seconds()`` trains a chain of tiny linear blocks, one per rank, through
``PipelineParallel`` with GPipe at 1 and at ``microbatches`` micro-batches: the extra
processor time per rank divided by the extra actions (2 per micro-batch), the median
over steps, averaged over the ranks. The blocks are too small to compute: what is left
is the runtime's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WIDTH = 8


class _Chain(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def action_seconds(*, microbatches: int = 8, steps: int = 4) -> float:
    """Processor seconds per schedule action of the pipeline runtime; 0 without
    torch.distributed or on one rank. Collective over the default group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return 0.0
    from ..device_mesh import DeviceMesh
    from ..parallel.pipeline import PipelineParallel

    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("PP",))
    x = torch.ones(microbatches, WIDTH)
    cpu = {}
    with torch.random.fork_rng(devices=[]):  # the chain's initialisation leaves the caller's RNG as it was
        for m in (1, microbatches):
            pipe = PipelineParallel(_Chain(world), mesh, schedule="gpipe", microbatches=m)
            runs = []
            for i in range(steps + 1):
                dist.barrier()
                t = time.process_time()
                pipe.step(x)
                if i:  # the first step checks the cut on meta
                    runs.append(time.process_time() - t)
            cpu[m] = statistics.median(runs)
    mine = max(0.0, (cpu[microbatches] - cpu[1]) / (2 * (microbatches - 1)))
    every = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(every)
    return float(every) / world
