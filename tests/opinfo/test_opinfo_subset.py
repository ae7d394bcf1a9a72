"""CI subset of the OpInfo conformance run: common ops of transformer training, one
sample each, every input placement combination (Partial included) on a 4-rank 1-d mesh
and a 2x2 mesh, forward and backward against the single-device result.

A "fallback" is correct by design (an op without a rule runs on replicated inputs); a
mismatch, an exception, a hang or a crash is not. The whole op_db runs with
``python -m tests.opinfo.run --out docs/op_coverage.md``."""

import torch

from .extra_samples import EXTRA
from .run import QUICK_OPS, run_ops


def _bad(results) -> dict:
    return {key: f"{r['vescale']['status']}: {r['vescale']['reason']}" for key, r in results.items()
            if r["vescale"]["status"] in ("fail", "hang", "crash")}


def test_common_ops_match_single_device():
    results = run_ops(list(QUICK_OPS), stacks=("vescale",), meshes=("1d4", "2d"), max_samples=1,
                      op_timeout_s=180)
    bad = _bad(results)
    assert not bad, "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
    ran = [k for k, r in results.items() if r["vescale"]["status"] != "skipped"]
    assert len(ran) == len(QUICK_OPS), f"skipped: {sorted(set(QUICK_OPS) - set(ran))}"


def test_empty_broadcast_and_0d_operands_match_single_device():
    """Only the samples of extra_samples.py: cat with legacy 1-d empty inputs, index_put
    with broadcast or 0-d values and bool masks, 0-d operands of the indexing ops."""
    results = run_ops(list(EXTRA), stacks=("vescale",), meshes=("1d4", "2d"), max_samples=0, combo_limit=16,
                      op_timeout_s=180)
    bad = _bad(results)
    assert not bad, "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
    assert all(r["vescale"]["samples"] == len(EXTRA[k](torch.float32, False))
               for k, r in results.items()), {k: r["vescale"]["samples"] for k, r in results.items()}
