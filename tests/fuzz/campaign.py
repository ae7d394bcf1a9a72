"""Differential fuzzing of op chains: vescale on 4 gloo ranks against plain torch.

    python -m tests.fuzz.campaign --chains 20000 --seed 0 --out docs/fuzz_campaign.json

Programs are drawn on this process from ``random.Random(seed + i)`` and sent to the ranks
in batches; every rank runs the same programs. A batch whose ranks hang or crash is re-run
one program at a time to find the culprit. Each finding is shrunk (shorter prefix, steps
nothing depends on dropped, inputs replicated) while it still fails the same way, and
printed as a literal that a regression test can hold.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "tests", "python")):
    if path not in sys.path:
        sys.path.insert(0, path)

from tests.fuzz.chains import MESHES, Program, generate  # noqa: E402
from tests.fuzz.ops import OPS_BY_NAME  # noqa: E402
from tests.fuzz.driver import run_cases, shrink as shrink_case  # noqa: E402
from tests.opinfo.pool import Ranks  # noqa: E402

HANDLER = "tests.fuzz.rank:handle"


def start_ranks(world: int = 4, gloo_timeout_s: float = 30) -> Ranks:
    ranks = Ranks(world, HANDLER, gloo_timeout_s=gloo_timeout_s, grace_s=gloo_timeout_s / 2)
    ranks.start()
    return ranks


def run_batch(ranks: Ranks, programs: list[Program], timeout_s: float = 120) -> list[tuple[str, str]]:
    """One verdict per program: ok, wrong, error, hang, crash or divergent."""
    return run_cases(ranks, programs, lambda ps: [p.to_literal() for p in ps], timeout_s)


# ---- shrinking ------------------------------------------------------------------------------

def _without_step(program: Program, drop: int) -> Program | None:
    """The program without step ``drop``; None when a later step uses its value."""
    n_in = len(program.inputs)
    dropped_value = n_in + drop
    steps = []
    for k, (name, args, params) in enumerate(program.steps):
        if k == drop:
            continue
        if dropped_value in args:
            return None
        steps.append([name, tuple(a - (a > dropped_value) for a in args), params])
    return dataclasses.replace(program, steps=steps)


def _without_input(program: Program, drop: int) -> Program | None:
    if len(program.inputs) == 1 or any(drop in args for _, args, _ in program.steps):
        return None
    steps = [[name, tuple(a - (a > drop) for a in args), params] for name, args, params in program.steps]
    return dataclasses.replace(program, inputs=[i for k, i in enumerate(program.inputs) if k != drop], steps=steps)


def _candidates(program: Program):
    for k in range(1, len(program.steps)):  # shorter prefixes first
        yield dataclasses.replace(program, steps=program.steps[:k])
    for k in range(len(program.steps) - 1, -1, -1):
        if (p := _without_step(program, k)) is not None:
            yield p
    for k in range(len(program.inputs)):
        if (p := _without_input(program, k)) is not None:
            yield p
        spec = program.inputs[k]
        for j, code in enumerate(spec[2]):
            if code != "R":
                placements = list(spec[2])
                placements[j] = "R"
                inputs = [list(i) for i in program.inputs]
                inputs[k] = [spec[0], spec[1], placements, spec[3]]
                yield dataclasses.replace(program, inputs=inputs)


def shrink(ranks: Ranks, program: Program, kind: str, budget: int = 60) -> Program:
    """A smaller program that still fails with the same kind of verdict."""
    return shrink_case(program, kind, _candidates, lambda p: run_batch(ranks, [p])[0][0], budget)


def training_mode(rng: random.Random) -> str:
    """"train.<optimizer>.<between the rounds>": which optimizer steps the inputs, and
    whether gradients are set to None, zeroed or kept (accumulated) before round two."""
    from .rank import OPTIMIZERS
    return f"train.{rng.choice(sorted(OPTIMIZERS))}.{rng.choice(['none', 'zero', 'keep'])}"


# ---- the campaign -------------------------------------------------------------------------------

def campaign(chains: int, seed: int, batch: int = 25, shrink_findings: bool = True, log=print,
             mesh: str | None = None, mode: str = "grad", boost: tuple[str, ...] = (), world: int = 4,
             max_steps: int = 6) -> dict:
    ranks = start_ranks(world)
    counts: collections.Counter = collections.Counter()
    findings = []
    started = time.monotonic()
    try:
        for first in range(0, chains, batch):
            seeds = list(range(seed + first, seed + min(first + batch, chains)))
            programs = [generate(random.Random(s), mesh, max_steps=max_steps, boost=boost) for s in seeds]
            for s, p in zip(seeds, programs):
                p.mode = training_mode(random.Random(s + 1)) if mode == "train" else mode
            for s, program, (kind, detail) in zip(seeds, programs, run_batch(ranks, programs)):
                counts[kind] += 1
                if kind == "ok":
                    continue
                small = shrink(ranks, program, kind) if shrink_findings else program
                findings.append({"seed": s, "kind": kind, "detail": detail, "program": small.to_literal(),
                                 "text": small.describe()})
                log(f"[seed {s}] {kind}: {detail}\n{small.describe()}\n")
            if (first // batch) % 20 == 0:
                log(f"{first + len(seeds)}/{chains} chains, {dict(counts)}, {time.monotonic() - started:.0f}s")
    finally:
        ranks.stop()
    return {"chains": chains, "seed": seed, "counts": dict(counts), "seconds": round(time.monotonic() - started),
            "findings": findings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--out", default=None, help="write counts and findings as JSON")
    parser.add_argument("--mesh", default=None, choices=sorted(MESHES),
                        help="draw every program on this mesh (default: 1d4 or 2d at random); it must span "
                             "every rank (a mesh over fewer leaves ranks outside it)")
    parser.add_argument("--world", type=int, default=4, help="ranks to start (3 or 6 for the odd meshes)")
    parser.add_argument("--inference", action="store_true",
                        help="run the steps under torch.inference_mode() (values only, no backward)")
    parser.add_argument("--train", action="store_true",
                        help="two rounds of forward, backward and an optimizer step over the inputs "
                             "(rank.py's OPTIMIZERS), every value and gradient compared")
    parser.add_argument("--boost", default="", help="comma-separated op names drawn 10 times as often")
    parser.add_argument("--max-steps", type=int, default=6,
                        help="steps per program at most (2..N drawn; longer chains compose more, run slower)")
    args = parser.parse_args()
    if math.prod(MESHES[args.mesh or "1d4"]) != args.world:
        parser.error(f"--mesh {args.mesh or '1d4 / 2d'} does not span --world {args.world} ranks")
    boost = tuple(name for name in args.boost.split(",") if name)
    unknown = [name for name in boost if name not in OPS_BY_NAME]
    if unknown:
        parser.error(f"--boost: no op named {', '.join(unknown)} in tests/fuzz/ops.py")
    result = campaign(args.chains, args.seed, args.batch, not args.no_shrink,
                      log=lambda *a: print(*a, file=sys.stderr, flush=True), mesh=args.mesh,
                      mode="inference" if args.inference else "train" if args.train else "grad", boost=boost, world=args.world,
                      max_steps=args.max_steps)
    print(json.dumps({k: v for k, v in result.items() if k != "findings"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
