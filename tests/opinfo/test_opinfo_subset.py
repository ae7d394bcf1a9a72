"""CI subset of the OpInfo conformance run: common ops of transformer training, one
sample each, every input placement combination (Partial included) on a 4-rank 1-d mesh
and a 2x2 mesh, forward and backward against the single-device result.

A "fallback" is correct by design (an op without a rule runs on replicated inputs); a
mismatch, an exception, a hang or a crash is not. The whole op_db runs with
``python -m tests.opinfo.run --out docs/op_coverage.md``."""

from .run import QUICK_OPS, run_ops


def test_common_ops_match_single_device():
    results = run_ops(list(QUICK_OPS), stacks=("vescale",), meshes=("1d4", "2d"), max_samples=1,
                      op_timeout_s=180)
    bad = {key: f"{r['vescale']['status']}: {r['vescale']['reason']}" for key, r in results.items()
           if r["vescale"]["status"] in ("fail", "hang", "crash")}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
    ran = [k for k, r in results.items() if r["vescale"]["status"] != "skipped"]
    assert len(ran) == len(QUICK_OPS), f"skipped: {sorted(set(QUICK_OPS) - set(ran))}"
