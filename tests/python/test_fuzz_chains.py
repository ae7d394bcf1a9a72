"""A short campaign of the chain fuzzer (tests/fuzz) in every test run: random chains of
2-6 training ops (in-place and view ops included, Partial inputs, uneven, empty and
size-1 dims, 1-d and 2-d meshes), forward and backward, against plain torch in float64.

The seeds are fixed so that a failure reproduces; VESCALE_FUZZ_SEED and
VESCALE_FUZZ_CHAINS pick others. The long campaign (docs/fuzzing.md) is
``python -m tests.fuzz.campaign --chains 20000`` (``--inference`` for inference mode,
``--train`` for two optimizer steps per program)."""

from __future__ import annotations

import os

from tests.fuzz.campaign import campaign


def _assert_all_ok(result: dict, chains: int) -> None:
    findings = "\n\n".join(f"seed {f['seed']}: {f['kind']}: {f['detail']}\n{f['text']}\nliteral: {f['program']}"
                            for f in result["findings"])
    assert result["counts"].get("ok", 0) == chains, f"{result['counts']}\n\n{findings}"


def test_random_chains_match_single_device():
    chains = int(os.environ.get("VESCALE_FUZZ_CHAINS", "400"))
    seed = int(os.environ.get("VESCALE_FUZZ_SEED", "7000000"))
    result = campaign(chains, seed, shrink_findings=True, log=lambda *a: None)
    _assert_all_ok(result, chains)


def test_random_chains_in_inference_mode_match_single_device():
    """The same generator's programs with their steps under torch.inference_mode()
    (inputs made outside it, as a model's parameters are): values only."""
    chains = int(os.environ.get("VESCALE_FUZZ_CHAINS", "400")) // 2
    seed = int(os.environ.get("VESCALE_FUZZ_SEED", "7000000")) + 500000
    result = campaign(chains, seed, shrink_findings=True, log=lambda *a: None, mode="inference")
    _assert_all_ok(result, chains)


def test_random_chains_trained_for_two_steps_match_single_device():
    """The same generator's programs as two training steps: forward, backward and an
    optimizer step (SGD, foreach and fused Adam, Adagrad) over the inputs, then again on
    the updated inputs; every value after each forward and each step, and the gradients."""
    chains = int(os.environ.get("VESCALE_FUZZ_CHAINS", "400")) // 2
    seed = int(os.environ.get("VESCALE_FUZZ_SEED", "7000000")) + 800000
    result = campaign(chains, seed, shrink_findings=True, log=lambda *a: None, mode="train")
    _assert_all_ok(result, chains)


def test_random_chains_on_a_2x3_mesh_match_single_device():
    """Six ranks on a 2x3 mesh: a dim of 7 splits 3/3/1 over the 3-long mesh dim, so
    some ranks' shards have dims of one element where others' do not. Decisions that
    read a shard rather than the global spec split the ranks there: a 6-rank campaign
    found such a hang (seed 84000575) that 4-rank meshes had not reached."""
    chains = int(os.environ.get("VESCALE_FUZZ_CHAINS", "400")) * 3 // 8
    seed = int(os.environ.get("VESCALE_FUZZ_SEED", "7000000")) + 900000
    result = campaign(chains, seed, shrink_findings=True, log=lambda *a: None, mesh="2d23", world=6)
    _assert_all_ok(result, chains)
