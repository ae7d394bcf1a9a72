"""Random ops give each rank the slice of what one device draws with the same seed,
and replicated results are identical on every rank."""

import pytest
import torch
import torch.nn.functional as F

from dist_utils import make_dtensor, mesh, mismatch, placement_options, rand

CASES = {
    "normal_": lambda x: x.normal_(1.0, 2.0),
    "uniform_": lambda x: x.uniform_(-1, 1),
    "bernoulli_": lambda x: x.bernoulli_(0.3),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "randint_like": lambda x: torch.randint_like(x, 0, 10),
    "dropout": lambda x: F.dropout(x, p=0.4, training=True),
    "native_dropout": lambda x: torch.ops.aten.native_dropout(x, 0.3, True)[0],
    "bernoulli_probs": lambda x: torch.bernoulli(torch.sigmoid(x)),
    "dropout_then_more": lambda x: F.dropout(x * 2, p=0.5) + torch.rand_like(x),
}


def _case_random(name: str, mesh_name: str):
    m = mesh(mesh_name)
    fn = CASES[name]
    full = rand((5, 6), seed=1)
    failures = []
    for p in placement_options(2, m.ndim):
        torch.manual_seed(123)
        expected = fn(full.clone())
        torch.manual_seed(123)
        with torch.no_grad():
            out = fn(make_dtensor(full, m, p, seed=2))
        err = mismatch(out.full_tensor(), expected)
        if err:
            failures.append(f"{p}: {err}")
        # the generators stay in step: the next draw agrees across ranks
        probe = torch.rand(3)
        gathered = [torch.empty(3) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, probe)
        if any(not torch.equal(g, probe) for g in gathered):
            failures.append(f"{p}: generators out of step after the draw")
    return failures


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mesh_name", ["1d4", "2d"])
def test_random_matches_single_device(pool4, name, mesh_name):
    for failures in pool4.run(_case_random, name, mesh_name):
        assert failures == []
