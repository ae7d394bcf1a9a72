"""One rank of a job that test_exit.py starts with torchrun: two worlds one after the
other (init_process_group ... destroy_process_group), each building a mesh, saving and
loading a checkpoint and ending as examples/demo.py does, with a broadcast of a status
tensor. At exit, after vescale's own exit handler, the rank writes how many threads it
had before torch.distributed started and how many it has left.

    python -m torch.distributed.run --standalone --nproc-per-node 4 exit_worker.py OUT_DIR
"""

from __future__ import annotations

import atexit
import os
import sys


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
BEFORE = _threads()
# Registered before vescale is imported, so atexit runs it after vescale's exit handler.
atexit.register(lambda: open(os.path.join(OUT, f"rank{RANK}.threads"), "w").write(f"{BEFORE} {_threads()}\n"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vescale  # noqa: E402
from vescale import Replicate, Shard  # noqa: E402


def one_world(i: int) -> None:
    # A store of its own per world: under torchrun's shared store, a second world's groups
    # would meet the first one's rendezvous keys (torch itself hangs there).
    dist.init_process_group("gloo", init_method="file://" + os.path.join(OUT, f"store{i}"),
                            rank=RANK, world_size=int(os.environ["WORLD_SIZE"]))
    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    full = torch.arange(30.0).reshape(5, 6) + i  # 5 rows over 2 ranks: uneven shards
    vescale.save(os.path.join(OUT, f"ckpt{i}"), {"x": vescale.distribute_tensor(full, mesh, [Shard(0), Shard(1)])})
    state = {"x": vescale.distribute_tensor(torch.zeros(5, 6), mesh, [Replicate(), Shard(0)])}
    vescale.load(os.path.join(OUT, f"ckpt{i}"), state)
    ok = torch.equal(state["x"].full_tensor(), full)
    status = torch.tensor([0 if ok else 1])
    dist.all_reduce(status)
    dist.broadcast(status, src=0)  # the demo's last collective: its tensor dies right after
    dist.destroy_process_group()
    if status.item() != 0:
        raise SystemExit(f"world {i}: the checkpoint did not load back its values")


for world in range(2):
    one_world(world)
