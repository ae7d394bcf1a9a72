"""Collective costs of the backend at hand: alpha-beta per collective kind and group size,
fitted to microbenchmarks on the ranks that will train.

``t(kind, g, bytes) = alpha[kind, g] + beta[kind, g] * bytes``, with ``bytes`` counted as
the collective recorder counts them (``vescale.debug.comm_trace``): this rank's input
(the local shard for an all-gather, the whole buffer for an all-reduce or a
reduce-scatter, the message for a send). Analytic ring models are off by a factor of
several on gloo (loopback TCP, ranks sharing cores), which is why they are measured.

``measure_comm(world)`` is collective: every rank of the default group calls it. Groups
of size g run ``world / g`` at once (as the rows of a mesh dim do), and every collective
follows a burst of compute on each rank (``gap_s``, 2 ms by default), as collectives in
a training step follow pieces of the model: when ranks share cores, a collective's time
is mostly the time its peers take to be scheduled, which a tight loop of collectives
after a barrier never sees (on 4 gloo ranks sharing 2 cores, an all-reduce over 4 ranks
takes ~0.6 ms back to back and ~10 ms between bursts of compute). The fit minimises
relative error (small messages matter as much as big).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..device_mesh import process_group

__all__ = ["CommModel", "measure_comm", "KINDS"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
# message sizes per kind where fewer will do: a broadcast only carries a loss in a step
_FEW = {"broadcast": (1 << 10,), "all_to_all": (1 << 10, 1 << 20)}
# bytes of this rank's input per measurement
SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


@dataclass
class CommModel:
    """alpha (s) and beta (s/byte) per (kind, group size)."""

    table: dict = field(default_factory=dict)      # (kind, g) -> (alpha, beta)
    points: dict = field(default_factory=dict)     # (kind, g) -> [(bytes, seconds)]
    source: str = ""
    seconds: float = 0.0                           # how long measuring took

    def time(self, kind: str, group_size: int, nbytes: float) -> float:
        if group_size <= 1:
            return 0.0
        kind = _canonical(kind)
        if kind == "send":  # between two ranks, whatever group they are in
            group_size = 2
        ab = self.table.get((kind, group_size))
        if ab is None:
            ab = self._nearest(kind, group_size)
        return ab[0] + ab[1] * nbytes

    def _nearest(self, kind: str, g: int) -> tuple[float, float]:
        same = [(k, v) for k, v in self.table.items() if k[0] == kind]
        if not same:
            same = [(k, v) for k, v in self.table.items() if k[0] == "all_reduce"]
        if not same:
            raise KeyError(f"the communication model has no entry for {kind} (known: {sorted(self.table)})")
        (_, g0), (a, b) = min(same, key=lambda kv: abs(math.log(kv[0][1] / g)))
        scale = (g - 1) / max(g0 - 1, 1)  # ring steps
        return a * scale, b * scale

    def to_dict(self) -> dict:
        return {"table": [[k, g, a, b] for (k, g), (a, b) in sorted(self.table.items())], "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "CommModel":
        return cls({(k, g): (a, b) for k, g, a, b in d["table"]}, source=d.get("source", ""))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CommModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def as_rows(self) -> list:
        """[(kind, group size, alpha, beta)] for the C++ planner."""
        return [(k, g, a, b) for (k, g), (a, b) in sorted(self.table.items())]

    def __str__(self) -> str:
        lines = [f"collective costs ({self.source}): alpha (us) + bytes / bandwidth (MB/s)"]
        for (k, g), (a, b) in sorted(self.table.items()):
            bw = f"{1 / b / 1e6:9.1f}" if b > 0 else "      inf"
            lines.append(f"  {k:15s} g={g}: {a * 1e6:8.1f} us + bytes / {bw} MB/s")
        return "\n".join(lines)


def _canonical(kind: str) -> str:
    return {"recv": "send", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all"}.get(kind, kind)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising the relative squared error of alpha + beta * x."""
    if len(points) == 1:
        x, y = points[0]
        return y, 0.0
    # weighted least squares with weights 1 / y^2
    sw = sx = sy = sxx = sxy = 0.0
    for x, y in points:
        w = 1.0 / max(y, 1e-9) ** 2
        sw, sx, sy, sxx, sxy = sw + w, sx + w * x, sy + w * y, sxx + w * x * x, sxy + w * x * y
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det else 0.0
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # through the origin
        alpha, beta = 0.0, sum(y / x for x, y in points if x) / len(points)
    if beta < 0:
        alpha, beta = statistics.median(y for _, y in points), 0.0
    return alpha, beta


def _groups(world: int, g: int):
    """Every rank creates every group (torch.distributed requires it); returns this rank's."""
    mine = None
    me = dist.get_rank()
    for start in range(0, world, g):
        ranks = list(range(start, start + g))
        pg = process_group(ranks) if g < world else dist.group.WORLD
        if me in ranks:
            mine = (pg, ranks)
    return mine


_burst_x = None


def _burst(seconds: float) -> None:
    """Compute for ``seconds`` (small matmuls), as a model's layers would between collectives."""
    global _burst_x
    if seconds <= 0:
        return
    if _burst_x is None:
        _burst_x = torch.randn(96, 96)
    t = time.perf_counter()
    x = _burst_x
    while time.perf_counter() - t < seconds:
        x = torch.tanh(x @ _burst_x * 0.01)


def _one(kind: str, pg, ranks: list[int], nbytes: int, gap_s: float = 0.0) -> float:
    g = len(ranks)
    _burst(gap_s)
    me = dist.get_rank()
    n = max(1, nbytes // 4)
    if kind == "all_reduce":
        x = torch.ones(n)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=pg)
    elif kind == "all_gather":
        x, out = torch.ones(n), torch.empty(n * g)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        t0 = time.perf_counter()
        gather(out, x, group=pg)
    elif kind == "reduce_scatter":
        n = max(g, n - n % g)
        x, out = torch.ones(n), torch.empty(n // g)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        t0 = time.perf_counter()
        scatter(out, x, group=pg)
    elif kind == "all_to_all":
        n = max(g, n - n % g)
        x, out = torch.ones(n), torch.empty(n)
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x, group=pg)
    elif kind == "broadcast":
        x = torch.ones(n)
        t0 = time.perf_counter()
        dist.broadcast(x, src=ranks[0], group=pg)
    else:  # send: a ping-pong between pairs (0, 1), (2, 3), ... of the group; one way = half
        x = torch.ones(n)
        i = ranks.index(me)
        peer = ranks[i ^ 1] if (i ^ 1) < g else None
        t0 = time.perf_counter()
        if peer is not None:
            if i % 2 == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
        return (time.perf_counter() - t0) / 2
    return time.perf_counter() - t0


# the kinds whose messages grow with the model (gradient buckets, ZeRO's gathers)
_BULK = ("all_reduce", "all_gather", "reduce_scatter")


def measure_comm(world: int | None = None, *, group_sizes=None, sizes=SIZES, reps: int = 4,
                 kinds=KINDS, gap_s: float = 0.002, largest: int = 0) -> CommModel:
    """Microbenchmarks every collective kind at every group size that divides the world
    (collective: every rank calls it) and fits alpha-beta to each. The ranks' medians
    are averaged, so every rank returns the same model. ``largest``: the bytes of the
    biggest buffer a step reduces (a gradient bucket, at most the model's parameters),
    measured too (twice) for the bulk kinds, so that the fit holds up to it: from the
    small sizes alone, gloo's all-reduce over 4 ranks sharing 2 cores extrapolates to a
    quarter of its measured time at 14 MiB (an all-gather's input there: a rank's slice)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_comm runs on the ranks that will train: initialise torch.distributed "
                           "(torchrun) first, or give the planner a CommModel")
    start = time.perf_counter()
    world = world or dist.get_world_size()
    if world != dist.get_world_size():
        raise ValueError(f"measure_comm(world={world}) but torch.distributed runs {dist.get_world_size()} ranks")
    group_sizes = group_sizes or [g for g in range(2, world + 1) if world % g == 0]
    keys, values = [], []
    for g in group_sizes:
        pg, ranks = _groups(world, g)
        for kind in kinds:
            if kind == "send" and g != min(group_sizes):
                continue  # the same pairs of ranks at every group size (ping-pong between neighbours)
            todo = [(nbytes, reps) for nbytes in (_FEW.get(kind, sizes) if sizes is SIZES else sizes)]
            big = largest // g if kind == "all_gather" else largest
            if kind in _BULK and big > max(nbytes for nbytes, _ in todo):
                todo.append((big, 2))
            for nbytes, times in todo:
                runs = []
                dist.barrier(group=pg)
                for i in range(times + 1):
                    t = _one(kind, pg, ranks, nbytes, gap_s)
                    if i:
                        runs.append(t)
                keys.append((kind, 2 if kind == "send" else g, nbytes))
                values.append(statistics.median(runs))
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    t /= world
    dist.barrier()
    points: dict = {}
    for (kind, g, nbytes), v in zip(keys, t.tolist()):
        points.setdefault((kind, g), []).append((float(nbytes), v))
    table = {k: fit(v) for k, v in points.items()}
    return CommModel(table, points, source=f"{dist.get_backend()}, measured on {world} ranks, {1e3 * gap_s:g} ms "
                                           f"compute between collectives",
                     seconds=time.perf_counter() - start)
