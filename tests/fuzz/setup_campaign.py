"""Differential fuzzing of whole training set-ups: ``vescale.parallelize`` on 4 gloo ranks
against the same training on one device (setups.py draws, setup_rank.py runs).

    python -m tests.fuzz.setup_campaign --setups 200 --seed 0 --out /tmp/setups.json

Set-ups are drawn from ``random.Random(seed + i)``; each finding is shrunk (features
taken away one at a time while it still fails the same way) and printed as a literal.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time

from tests.fuzz.campaign import ROOT  # noqa: F401  (puts the repository on sys.path)
from tests.fuzz.setups import WORLD, describe, draw, simpler
from tests.fuzz.driver import run_cases, shrink as shrink_case
from tests.opinfo.pool import Ranks

HANDLER = "tests.fuzz.setup_rank:handle"


def start_ranks(gloo_timeout_s: float = 60, world: int = WORLD) -> Ranks:
    ranks = Ranks(world, HANDLER, gloo_timeout_s=gloo_timeout_s, grace_s=gloo_timeout_s / 2)
    ranks.start()
    return ranks


def run_batch(ranks: Ranks, setups: list[dict], work_dir: str, timeout_s: float = 300) -> list[tuple[str, str]]:
    """One verdict per set-up: ok, wrong, refused, error, hang, crash or divergent."""
    return run_cases(ranks, setups, lambda batch: (work_dir, batch), timeout_s)


def shrink(ranks: Ranks, setup: dict, kind: str, work_dir: str, budget: int = 40) -> dict:
    return shrink_case(setup, kind, simpler, lambda s: run_batch(ranks, [s], work_dir)[0][0], budget)


def run_literals(setups: list[dict], world: int = WORLD) -> list[tuple[str, str]]:
    """The verdicts of the given set-ups (regression literals), on ``world`` ranks of their own."""
    ranks = start_ranks(world=world)
    try:
        return run_batch(ranks, setups, tempfile.mkdtemp(prefix="vescale-setups-"))
    finally:
        ranks.stop()


# Every set-up makes its meshes, whose process groups (and gloo's threads: ~6 per group)
# live as long as the ranks; fresh ranks every so often keep a long campaign's pace.
_SETUPS_PER_START = 50


def _has(setup: dict, path: str) -> bool:
    """Whether ``setup`` holds a true value at ``path`` ("loop.prompts", "model.branch")."""
    value = setup
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return bool(value)


def campaign(count: int, seed: int, batch: int = 5, shrink_findings: bool = True, log=print,
             world: int = WORLD, require: str | None = None) -> dict:
    ranks = start_ranks(world=world)
    work_dir = tempfile.mkdtemp(prefix="vescale-setups-")
    counts: collections.Counter = collections.Counter()
    findings = []
    started = time.monotonic()
    try:
        for first in range(0, count, batch):
            if first and first % _SETUPS_PER_START < batch:
                ranks.restart()
            drawn = [(s, draw(random.Random(s), world)) for s in range(seed + first, seed + min(first + batch, count))]
            kept = [(s, x) for s, x in drawn if require is None or _has(x, require)]  # a targeted campaign
            if require is not None:
                counts["skipped"] += len(drawn) - len(kept)
            if not kept:
                continue
            seeds, setups = [s for s, _ in kept], [x for _, x in kept]
            for s, setup, (kind, detail) in zip(seeds, setups, run_batch(ranks, setups, work_dir)):
                counts[kind] += 1
                if kind == "ok":
                    continue
                small = shrink(ranks, setup, kind, work_dir) if shrink_findings else setup
                findings.append({"seed": s, "kind": kind, "detail": detail, "setup": small})
                log(f"[seed {s}] {kind}: {detail}\n{describe(small)}\n")
            log(f"{first + len(drawn)}/{count} set-ups, {dict(counts)}, {time.monotonic() - started:.0f}s")
    finally:
        ranks.stop()
    return {"setups": count, "seed": seed, "world": world, "counts": dict(counts), "seconds": round(time.monotonic() - started),
            "findings": findings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks (meshes of every factorisation)")
    parser.add_argument("--require", default=None, help="run only the seeds whose set-up holds this (loop.prompts)")
    parser.add_argument("--out", default=None, help="write counts and findings as JSON")
    args = parser.parse_args()
    result = campaign(args.setups, args.seed, args.batch, not args.no_shrink,
                      log=lambda *a: print(*a, file=sys.stderr, flush=True), world=args.world, require=args.require)
    print(json.dumps({k: v for k, v in result.items() if k != "findings"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
