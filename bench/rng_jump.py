#!/usr/bin/env python
"""Cost of moving torch's CPU generator (MT19937) forward by n outputs: streaming (the
624-word state regenerated block by block, no tempering) against jumping (t^n mod the
characteristic polynomial over GF(2), applied by Horner's rule), and against drawing
the numbers (uniform_ on n floats); medians of repeats. The crossover sets
vescale::mt::jump_threshold (sharding_rules/mt_jump.cpp).

    .venv/bin/python bench/rng_jump.py
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vescale import _C  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()[0]:.1f}; jump threshold: {_C._rng_jump_threshold()} outputs")
    _C._rng_advance(10**6, "jump")  # the characteristic polynomial, once per process
    print("%12s %12s %12s %14s %12s" % ("n", "jump ms", "stream ms", "stream ns/out", "uniform_ ms"))
    for e in range(16, 35, 2):
        n = 1 << e
        jump = median_ms(lambda: _C._rng_advance(n, "jump"), 5)
        stream = median_ms(lambda: _C._rng_advance(n, "stream"), 3) if e <= 32 else float("nan")
        draw = median_ms(lambda: torch.empty(n).uniform_(), 3) if e <= 26 else float("nan")
        print("%12s %12.2f %12.2f %14.3f %12.2f" % (f"2^{e}", jump, stream, stream * 1e6 / n, draw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
