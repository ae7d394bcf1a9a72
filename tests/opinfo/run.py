"""OpInfo conformance runner: torch's op_db on vescale's DTensor and on torch's own.

    .venv/bin/python -m tests.opinfo.run --out docs/op_coverage.md            # everything
    .venv/bin/python -m tests.opinfo.run --ops softmax addmm --stack vescale   # a few ops
    .venv/bin/python -m tests.opinfo.run --quick                               # the CI subset

The parent process holds no DTensors: it sends "run op X on stack S and mesh M" to four
gloo ranks (tests/opinfo/check.py does the work there), gathers their answers, and
restarts them when an op leaves them hung, dead or out of step, so one bad op never
stops the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter

from . import check, report
from .pool import Ranks, log

WORLD = 4
MESHES = ("1d4", "2d")
STACKS = ("vescale", "torch")

# The CI subset: common ops of transformer training, one sample each.
QUICK_OPS = (
    "add", "mul", "sub", "div.no_rounding_mode", "neg", "exp", "tanh", "sigmoid", "nn.functional.relu",
    "nn.functional.gelu", "nn.functional.silu", "sum", "mean", "amax", "max.reduction_with_dim", "var",
    "matmul", "mm", "bmm", "addmm", "softmax", "log_softmax", "nn.functional.layer_norm",
    "nn.functional.embedding", "nn.functional.cross_entropy", "transpose", "permute", "view", "reshape",
    "t", "squeeze", "unsqueeze", "cat", "stack", "split", "chunk", "select", "narrow", "where", "clone",
)

# Answers that mean a collective failed or waited out its timeout inside the ranks.
_COLLECTIVE_ERRORS = ("timed out", "connection closed", "connection reset", "broken pipe")


def all_op_keys() -> list[str]:
    from torch.testing._internal.common_methods_invocations import op_db
    return sorted(check.op_key(op) for op in op_db)


def select_ops(names: list[str] | None) -> list[str]:
    """Each name picks the op of that exact key, or else every op whose key contains it."""
    keys = all_op_keys()
    if not names:
        return keys
    chosen = []
    for name in names:
        hits = [name] if name in keys else [k for k in keys if name in k]
        if not hits:
            raise SystemExit(f"no op_db entry matches {name!r}")
        chosen += [k for k in hits if k not in chosen]
    return chosen


def run_ops(keys, *, stacks=STACKS, meshes=MESHES, max_samples=4, combo_limit=30,
            op_timeout_s=180.0, results: dict | None = None, after_op=None) -> dict:
    """{op key: {stack: result dict}}; ``results`` (from an earlier run) is updated in place,
    and ``after_op()`` is called after each op (to save progress)."""
    results = {} if results is None else results
    ranks = Ranks(WORLD, f"{check.__name__}:handle")
    opts = dict(max_samples=max_samples, combo_limit=combo_limit)
    ranks.start()  # before the clock of the first op starts
    log(f"rank output: {ranks.log_dir}")
    try:
        for n, key in enumerate(keys, 1):
            for stack in stacks:
                start = time.monotonic()
                per_mesh = {}
                for m in meshes:
                    per_mesh[m] = _run_one(ranks, key, stack, m, opts, op_timeout_s)
                    if per_mesh[m]["status"] in ("hang", "crash"):
                        break  # another mesh would most likely cost another timeout
                res = _merge_meshes(per_mesh)
                res["seconds"] = round(time.monotonic() - start, 2)
                results.setdefault(key, {})[stack] = res
                log(f"[{n}/{len(keys)}] {key:<40} {stack:<8} {res['status']:<8} {res['seconds']:6.1f}s "
                    f"{res['samples']}s/{res['combos']}c {res['reason'][:150]}")
            if after_op is not None:
                after_op()
    finally:
        ranks.stop()
    return results


def _run_one(ranks: Ranks, key: str, stack: str, mesh: str, opts: dict, timeout_s: float) -> dict:
    reply = ranks.call(("run", key, stack, mesh, opts), timeout_s)
    if not reply.values:
        return vars(check.Outcome(reply.kind, reply.message))
    outcomes = reply.values  # rank -> its Outcome; every rank's unless some hung or died
    statuses = [o["status"] for o in outcomes.values()]
    waited = {r: any(e in o["reason"].lower() for e in _COLLECTIVE_ERRORS) for r, o in outcomes.items()}
    # The worst outcome, as told by a rank that did not merely time out waiting for the others.
    first = min(outcomes, key=lambda r: (waited[r], -check.STATUS_ORDER.index(outcomes[r]["status"]), r))
    res = dict(outcomes[first])
    if reply.kind != "ok":  # the others never answered: they wait in a collective this rank left
        res["status"], res["reason"] = reply.kind, f"{res['reason']} (rank {first}; {reply.message})"
    elif any(waited.values()):
        res["status"] = "hang"
        if not waited[first]:
            res["reason"] += f" (rank {first}; ranks {[r for r in waited if waited[r]]} timed out waiting)"
    elif len(set(statuses)) > 1:
        res["reason"] += f" (rank {first}; ranks gave {statuses})"
    # An exception at different points (or on some ranks only) leaves collectives unmatched.
    if reply.kind == "ok" and (res["status"] == "hang" or len({tuple(o["stopped_at"]) for o in outcomes.values()}) > 1):
        ranks.restart()
    return res


def _merge_meshes(per_mesh: dict) -> dict:
    worst_mesh = max(per_mesh, key=lambda m: check.STATUS_ORDER.index(per_mesh[m]["status"]))
    worst = per_mesh[worst_mesh]
    fallbacks = Counter()
    for r in per_mesh.values():
        fallbacks.update(r["fallbacks"])
    notes = sorted({n for r in per_mesh.values() for n in r["notes"]})
    return dict(status=worst["status"],
                reason=f"{worst_mesh}: {worst['reason']}" if worst["reason"] else "",
                meshes={m: r["status"] for m, r in per_mesh.items()},
                fallbacks=dict(fallbacks), notes=notes,
                samples=max(r["samples"] for r in per_mesh.values()),
                combos=sum(r["combos"] for r in per_mesh.values()),
                failed_combos=sum(r["failed_combos"] for r in per_mesh.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the markdown table here (e.g. docs/op_coverage.md)")
    p.add_argument("--json", help="raw results: read (if there) and merged with this run, then written back")
    p.add_argument("--ops", nargs="+", help="op_db keys (name or name.variant), exact or substring")
    p.add_argument("--max-samples", type=int, default=4, help="samples per op (default 4)")
    p.add_argument("--combo-limit", type=int, default=30,
                   help="run every placement combination up to this many, else a covering set (default 30)")
    p.add_argument("--meshes", default=",".join(MESHES), help="comma-separated: 1d4,2d")
    p.add_argument("--stack", choices=("vescale", "torch", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="the CI subset: common ops, 1 sample, 1d4 mesh")
    p.add_argument("--op-timeout", type=float, default=180, help="seconds before an op counts as hung")
    p.add_argument("--resume", action="store_true",
                   help="skip ops that --json already has results for (an interrupted run goes on)")
    p.add_argument("--report-only", action="store_true", help="write --out from --json without running")
    args = p.parse_args(argv)
    if args.report_only:
        with open(args.out, "w") as f:
            f.write(report.markdown(**_load(args.json)))
        return 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the ranks are stopped
    if args.quick:
        args.ops, args.max_samples, args.meshes = args.ops or list(QUICK_OPS), 1, "1d4"
    keys = select_ops(args.ops)
    stacks = STACKS if args.stack == "both" else (args.stack,)
    meshes = tuple(m for m in args.meshes.split(",") if m)
    previous = _load(args.json)
    if args.resume:
        keys = [k for k in keys if not all(s in previous["results"].get(k, {}) for s in stacks)]
    run = dict(command="python -m tests.opinfo.run " + " ".join(sys.argv[1:] if argv is None else argv),
               max_samples=args.max_samples, combo_limit=args.combo_limit, meshes=list(meshes),
               stacks=list(stacks), ops=len(keys), **report.machine())
    start = time.monotonic()
    previous["runs"].append(run)

    def save() -> None:
        run["minutes"] = round((time.monotonic() - start) / 60, 1)
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(previous, f, indent=1, sort_keys=True)
            os.replace(args.json + ".tmp", args.json)

    results = run_ops(keys, stacks=stacks, meshes=meshes, max_samples=args.max_samples,
                      combo_limit=args.combo_limit, op_timeout_s=args.op_timeout, results=previous["results"],
                      after_op=save)
    if report.engine_version() != run["vescale"]:
        run["rebuilt"] = report.engine_version()
    save()
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.markdown(**previous))
    ran = {k: results[k] for k in keys}
    for stack in stacks:
        log(stack, dict(Counter(r[stack]["status"] for r in ran.values())))
    bad = [k for k in keys for s in stacks if ran[k][s]["status"] in ("fail", "hang", "crash")]
    return 1 if bad else 0


def _load(path: str | None) -> dict:
    if path:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            pass
    return {"results": {}, "runs": []}


if __name__ == "__main__":
    sys.exit(main())
