"""Bad input raises a Python exception that names the problem and the fix; the
process survives and keeps computing correctly afterwards."""

import io

import pytest
import torch

import vescale
from vescale import Partial, Replicate, Shard

from dist_utils import make_dtensor, mesh, mismatch, rand


def _raises(fn, exc_type, *needles):
    """None if fn() raises exc_type with every needle in its message; else a description."""
    try:
        fn()
    except exc_type as e:
        missing = [n for n in needles if n not in str(e)]
        return f"message lacks {missing}: {e}" if missing else None
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__} instead of {exc_type.__name__}: {e}"
    return f"did not raise {exc_type.__name__}"


def _still_works(m) -> str | None:
    a = rand((4, 6), seed=1)
    x = make_dtensor(a, m, [Shard(0)] + [Replicate()] * (m.ndim - 1))
    return mismatch((x * 2 + 1).sum(0).full_tensor(), (a * 2 + 1).sum(0))


def _write_into_view_of_shared_base() -> str | None:
    """Once refused with an error; now a write into a view taken from a copy reaches the
    base and every alias of it, as on one device (dispatch/view_copies.h)."""
    m = mesh("1d4")
    full = rand((4, 6), seed=5)
    y = make_dtensor(full, m, [Shard(1)])
    alias = y.view(4, 6)  # shares y's storage, so y can't be re-laid out in place
    column = y[:, 2]      # selecting along the split dim needs that dim whole: a copy
    column.fill_(0.0)
    expected = full.clone()
    expected[:, 2] = 0.0
    for name, t in (("base", y), ("alias", alias)):
        if not torch.equal(t.full_tensor(), expected):
            return f"the write into the view did not reach the {name}"
    return None


def _refused_by_the_meta_kernel(x) -> str | None:
    """An op's own argument error (its meta kernel refuses the call) is torch's error; the
    fallback it went through first says so rather than "no meta kernel"."""
    err = _raises(lambda: x.view(7), RuntimeError, "shape '[7]' is invalid")
    if err:
        return err
    reasons = {op: why for op, _, why in vescale.debug.fallback_report()}
    return None if "its meta kernel refused the call" in reasons.get("aten::view", "") else \
        f"fallback reason of aten::view: {reasons.get('aten::view')!r}"


def _setitem(x, value):
    x[:, :, 1:3] = value


def _split_lookups(m) -> dict[str, str | None]:
    """Indices a single device refuses, in a lookup whose table is split over the mesh (a
    vocab-split embedding, cross-entropy over split classes or split rows): once each rank
    looked up what it owned and zeroes stood for the rest, a wrong answer without an error.
    Ignored targets (-100, or ignore_index) are not refused, and give one device's loss."""
    R, rest = Replicate(), [Replicate()] * (m.ndim - 1)
    weight, logits = rand((10, 4), seed=6), rand((3, 10), seed=7)
    table = make_dtensor(weight, m, [Shard(0)] + rest)
    ids = make_dtensor(torch.tensor([[1, 12, 3]]), m, [R] * m.ndim)
    bad, ignored = torch.tensor([1, 11, 2]), torch.tensor([1, -100, 9])
    checks = {"embedding index out of range (vocab split)": _raises(
        lambda: torch.nn.functional.embedding(ids, table), IndexError, "index 12", "[0, 10)")}
    for dim in (0, 1):
        split = make_dtensor(logits, m, [Shard(dim)] + rest)
        checks[f"target out of range (logits split on {dim})"] = _raises(
            lambda: torch.nn.functional.cross_entropy(split, make_dtensor(bad, m, [R] * m.ndim)), IndexError,
            "target 11", "[0, 10)")
        for target, ignore in ((ignored, -100), (bad, 11)):
            got = torch.nn.functional.cross_entropy(split, make_dtensor(target, m, [R] * m.ndim), ignore_index=ignore)
            want = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore)
            checks[f"ignored target {ignore} (logits split on {dim})"] = mismatch(got.full_tensor(), want)
    return checks


def _case_errors():
    m1, m2 = mesh("1d4"), mesh("2d")
    t = rand((4, 6), seed=2)
    x = make_dtensor(t, m1, [Shard(0)])
    checks = {
        "shard dim out of range (distribute)": _raises(
            lambda: vescale.distribute_tensor(t, m1, [Shard(2)]), IndexError, "Shard(2)", "out of range", "[-2, 1]"),
        "shard dim out of range (from_local)": _raises(
            lambda: vescale.DTensor.from_local(torch.ones(2, 2), m1, [Shard(-3)]), IndexError, "Shard(-3)"),
        "shard dim out of range (redistribute)": _raises(
            lambda: x.redistribute(m1, [Shard(5)]), IndexError, "Shard(5)"),
        "wrong number of placements": _raises(
            lambda: x.redistribute(m1, [Shard(0), Replicate()]), ValueError, "2 placements", "1-d mesh"),
        "unknown reduce op": _raises(lambda: Partial("mean"), ValueError, "reduce_op", "'mean'"),
        "not a placement": _raises(lambda: x.redistribute(m1, ["S0"]), TypeError, "'S0'", "Shard"),
        "shard dim not an int": _raises(lambda: Shard("0"), TypeError, "int"),
        "different meshes in one op": _raises(
            lambda: x + make_dtensor(t, m2, [Shard(0), Replicate()]), ValueError,
            "aten::add.Tensor", "different device meshes", "redistribute"),
        "redistribute across meshes": _raises(lambda: x.redistribute(m2, [Replicate(), Replicate()]), ValueError,
                                              "another mesh"),
        "mesh larger than the world": _raises(lambda: vescale.init_device_mesh("cpu", (4, 4)), ValueError,
                                              "16 ranks", "world has 4", "torchrun"),
        "mesh ranks outside the world": _raises(lambda: vescale.DeviceMesh("cpu", [0, 7]), ValueError, "[7]"),
        "unknown mesh dim name": _raises(lambda: m2.get_strategy_size("PP"), KeyError, "'PP'", "DP"),
        "data_ptr": _raises(lambda: x.data_ptr(), RuntimeError, "data_ptr()", "to_local()"),
        "tolist": _raises(lambda: x.tolist(), RuntimeError, "tolist()", "full_tensor().tolist()"),
        "numpy": _raises(lambda: x.numpy(), RuntimeError, "numpy()", "to_local().numpy()"),
        "__array__": _raises(lambda: x.__array__(), RuntimeError, "full_tensor()", "to_local()"),
        "storage": _raises(lambda: x.untyped_storage(), RuntimeError, "DTensorImpl", "to_local()"),
        "torch.save": _raises(lambda: torch.save({"w": x}, io.BytesIO()), RuntimeError, "vescale.save(path, state)"),
        "local shape does not fit the global shape": _raises(
            lambda: vescale.DTensor.from_local(torch.ones(3, 6), m1, [Shard(0)], shape=(4, 6)), ValueError,
            "shape [3, 6]", "shard of shape"),
        "distribute a DTensor": _raises(lambda: vescale.distribute_tensor(x, m1, [Replicate()]), TypeError,
                                        "redistribute"),
        "DTensor constructor": _raises(lambda: vescale.DTensor(), TypeError, "from_local"),
        "write into a view of a copy": _write_into_view_of_shared_base(),
        "an argument the meta kernel refuses": _refused_by_the_meta_kernel(x),
        # Five columns over four ranks leave rank 3 an empty shard: it once skipped the
        # error the others raised and waited alone in the next collective.
        "write into a slice of an expanded tensor": _raises(
            lambda: _setitem(make_dtensor(rand((4, 5), seed=3), m1, [Shard(1)]).expand(2, 4, 5), 1.0),
            RuntimeError, "expanded tensor", "clone()"),
    }
    checks.update(_split_lookups(m1))
    checks.update({f"{k} (2-d mesh)": v for k, v in _split_lookups(m2).items()})
    failures = {k: v for k, v in checks.items() if v is not None}
    after = _still_works(m1) or _still_works(m2)
    if after:
        failures["process keeps working"] = after
    return failures


def test_bad_input_errors(pool4):
    for failures in pool4.run(_case_errors):
        assert failures == {}


@pytest.mark.parametrize("mesh_name", ["1d4"])
def test_errors_keep_pool_usable(pool4, mesh_name):
    # A second round on the same ranks: nothing was left half-done by the errors.
    for failures in pool4.run(_case_errors):
        assert failures == {}
