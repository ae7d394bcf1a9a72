#!/usr/bin/env python
"""Random draws on a GPU: a rank's block alone (vescale's box draw, the values of the whole
draw) against the whole draw every rank made before (and still makes where the box draw
does not apply), on one GPU.

    python bench/rng_cuda.py [--reps 20]

Cases: dropout of a sequence-parallel activation (batch 8, sequence 2048, hidden 4096,
bfloat16; a rank holds 1/4 or 1/8 of the sequence) and normal_ initialisation of a
16384 x 4096 fp32 weight (a rank holds 1/8 of the rows, or of the columns). Each way is
timed with CUDA events, warmed up, medians of --reps runs; the box draws are checked
against the whole draw's values first. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vescale import _C  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _dropout_case(shape, parts: int, reps: int) -> dict:
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    seq = shape[1] // parts
    offsets, sizes = [0, seq, 0], [shape[0], seq, shape[2]]  # the second rank's block
    box = x[:, seq:2 * seq].contiguous()
    torch.cuda.manual_seed(1)
    want = torch.ops.aten.native_dropout(x, 0.1, True)
    torch.cuda.manual_seed(1)
    got = _C._rng_dropout_box(box, 0.1, list(shape), offsets, sizes)
    same = all(torch.equal(g, w[:, seq:2 * seq]) for g, w in zip(got, want))
    whole = _median_ms(lambda: torch.ops.aten.native_dropout(x, 0.1, True), reps)
    local = _median_ms(lambda: _C._rng_dropout_box(box, 0.1, list(shape), offsets, sizes), reps)
    return dict(case=f"dropout {tuple(shape)} bf16, 1/{parts} of the sequence", whole_ms=whole, box_ms=local,
                same=same)


def _normal_case(shape, parts: int, dim: int, reps: int) -> dict:
    w = torch.empty(shape, device="cuda")
    offsets = [0, 0]
    sizes = list(shape)
    sizes[dim] = shape[dim] // parts
    offsets[dim] = sizes[dim]  # the second rank's block
    out = torch.empty(sizes, device="cuda")
    torch.cuda.manual_seed(1)
    w.normal_(0.0, 0.02)
    torch.cuda.manual_seed(1)
    _C._rng_draw_box("normal_", 0.0, 0.02, list(shape), offsets, sizes, out)
    same = torch.equal(out, w[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])
    whole = _median_ms(lambda: w.normal_(0.0, 0.02), reps)
    local = _median_ms(lambda: _C._rng_draw_box("normal_", 0.0, 0.02, list(shape), offsets, sizes, out), reps)
    return dict(case=f"normal_ {tuple(shape)} fp32, 1/{parts} of dim {dim}", whole_ms=whole, box_ms=local, same=same)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = [_dropout_case((8, 2048, 4096), 4, args.reps), _dropout_case((8, 2048, 4096), 8, args.reps),
            _normal_case((16384, 4096), 8, 0, args.reps), _normal_case((16384, 4096), 8, 1, args.reps)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"| case | whole draw ms | box draw ms | box / whole | box values = whole's |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['case']} | {r['whole_ms']:.3f} | {r['box_ms']:.3f} | {r['box_ms'] / r['whole_ms']:.2f} | "
              f"{r['same']} |")


if __name__ == "__main__":
    main()
