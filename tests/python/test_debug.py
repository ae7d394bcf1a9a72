"""Seeing into the engine: vescale.explain, visualize, check_replicas, detect_anomaly, the
bounded caches, and the rule registry's check of operator names (vescale.debug.comm_trace
is test_comm_trace.py's).

Golden explanations are written out by reasoning about each op; only the modelled costs
are taken from the cost model (``_C.plan_redistribution``), each for the redistribution
the candidate needs."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import vescale
from vescale import InterleavedShard, Partial, Replicate, Shard
from vescale.parallel import parallelize_module
from vescale.parallel.ddp import local_of

from dist_utils import mesh
from test_comm_trace import _dp_tp_model

R, S0, S1 = ("R",), ("S", 0), ("S", 1)
PSUM, PAVG = ("P", "sum"), ("P", "avg")


# ---- the registry ---------------------------------------------------------------------------

def test_every_rule_names_an_existing_operator():
    """A misspelt rule name would silently leave its op to the fallback; the registry
    records such names (GoogleTest Registry.* shows that it does) and none may be left."""
    assert vescale._C.missing_rule_ops() == []
    names = vescale._C.rule_names()
    assert names, "no rule registered"
    for name in names:
        op, _, overload = name.partition(".")
        torch._C._dispatch_find_schema_or_throw(op, overload)  # raises for a name the dispatcher lacks


# ---- vescale.explain ------------------------------------------------------------------------

def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3f} us"


def _cost(t, src, dst, shape) -> float:
    """The cost model's price of moving a float32 tensor of `shape` from `src` to `dst`."""
    return 0.0 if src == dst else vescale._C.plan_redistribution(vescale._C.mesh_of(t), [src], [dst], list(shape),
                                                                  torch.float32)[1]


def _case_explain_golden():
    m = mesh("1d2")
    rank = dist.get_rank()
    out = {}

    # mm: A [4, 6] split by rows times B [6, 8] split by columns. Keeping B's columns and
    # gathering A (the smaller operand: 96 bytes against 192) is the cheapest strategy;
    # the result is split by columns. Each rank sends its 2 x 6 float32 rows: 48 bytes.
    a = vescale.distribute_tensor(torch.randn(4, 6), m, [Shard(0)])
    b = vescale.distribute_tensor(torch.randn(6, 8), m, [Shard(1)])
    ca = lambda dst: _cost(a, S0, dst, (4, 6))  # noqa: E731
    cb = lambda dst: _cost(b, S1, dst, (6, 8))  # noqa: E731
    mesh_str = repr(vescale._C.mesh_of(a))
    mm_body = f"""\
  input self: [Shard(0)] [4, 6] Float -> [Replicate()] by all_gather(dim=0, mesh_dim=0), cost {_us(ca(R))}
  input mat2: [Shard(1)] [6, 8] Float, used as it is
  candidates (inputs -> results: cost of moving the inputs; * chosen):
    [Replicate()], [Replicate()] -> [Replicate()]: {_us(0.0 + ca(R) + cb(R))}
    [Shard(0)], [Replicate()] -> [Shard(0)]: {_us(0.0 + ca(S0) + cb(R))}
  * [Replicate()], [Shard(1)] -> [Shard(1)]: {_us(0.0 + ca(R) + cb(S1))}
    [Shard(1)], [Shard(0)] -> [Partial(sum)]: {_us(0.0 + ca(S1) + cb(S0))}
    [Partial(sum)], [Replicate()] -> [Partial(sum)]: {_us(0.0 + ca(PSUM) + cb(R))}
    [Replicate()], [Partial(sum)] -> [Partial(sum)]: {_us(0.0 + ca(R) + cb(PSUM))}
    [Partial(avg)], [Replicate()] -> [Partial(avg)]: {_us(0.0 + ca(PAVG) + cb(R))}
    [Replicate()], [Partial(avg)] -> [Partial(avg)]: {_us(0.0 + ca(R) + cb(PAVG))}
  collective: all_gather on mesh dim 0 (TP), 2 ranks, 48 bytes
  result 0: [Shard(1)] [4, 8] Float"""
    vescale.debug.clear_cache()
    first = vescale.explain(torch.matmul, a, b)
    second = vescale.explain(torch.matmul, a, b)
    out["mm"] = (str(first), f"aten::mm on {mesh_str}: decided now (cache miss)\n{mm_body}")
    out["mm again"] = (str(second), f"aten::mm on {mesh_str}: cache hit\n{mm_body}")
    out["mm result"] = (first.result.placements, (Shard(1),))
    out["mm structured"] = ([d.op for d in first], ["aten::mm"])
    out["mm chosen"] = ([c["str"] for c in first[0].candidates if c["chosen"]],
                        ["[Replicate()], [Shard(1)] -> [Shard(1)]"])

    # add: a Partial(sum) plus a replicated tensor. The replicated addend must count once
    # in the sum: it becomes Partial locally (kept on one rank, zeros on the other), which
    # sends nothing; reducing the Partial first would cost an all-reduce.
    p = vescale.DTensor.from_local(torch.full((4, 6), float(rank + 1)), m, [Partial()])
    r = vescale.distribute_tensor(torch.arange(24.0).reshape(4, 6), m, [Replicate()])
    cp = lambda dst: _cost(p, PSUM, dst, (4, 6))  # noqa: E731
    cr = lambda dst: _cost(r, R, dst, (4, 6))  # noqa: E731
    add = vescale.explain(torch.add, p, r)
    out["add"] = (str(add), f"""\
aten::add.Tensor on {mesh_str}: decided now (cache miss)
  input self: [Partial(sum)] [4, 6] Float, used as it is
  input other: [Replicate()] [4, 6] Float -> [Partial(sum)] by to_partial(sum, mesh_dim=0), cost {_us(cr(PSUM))}
  candidates (inputs -> results: cost of moving the inputs; * chosen):
    [Replicate()], [Replicate()] -> [Replicate()]: {_us(0.0 + cp(R) + cr(R))}
    [Shard(0)], [Shard(0)] -> [Shard(0)]: {_us(0.0 + cp(S0) + cr(S0))}
    [Shard(1)], [Shard(1)] -> [Shard(1)]: {_us(0.0 + cp(S1) + cr(S1))}
  * [Partial(sum)], [Partial(sum)] -> [Partial(sum)]: {_us(0.0 + cp(PSUM) + cr(PSUM))}
    [Partial(avg)], [Partial(avg)] -> [Partial(avg)]: {_us(0.0 + cp(PAVG) + cr(PAVG))}
  collectives: none
  result 0: [Partial(sum)] [4, 6] Float""")
    out["add value"] = (torch.equal(add.result.full_tensor(), 3.0 + torch.arange(24.0).reshape(4, 6)), True)

    # sum over the split dim: each rank sums its rows, and the row sums add up across
    # ranks: a Partial(sum) result, with nothing sent.
    s = vescale.distribute_tensor(torch.randn(4, 6), m, [Shard(0)])
    cs = lambda dst: _cost(s, S0, dst, (4, 6))  # noqa: E731
    total = vescale.explain(torch.sum, s, 0)
    out["sum"] = (str(total), f"""\
aten::sum.dim_IntList on {mesh_str}: decided now (cache miss)
  input self: [Shard(0)] [4, 6] Float, used as it is
  candidates (inputs -> results: cost of moving the inputs; * chosen):
    [Replicate()] -> [Replicate()]: {_us(0.0 + cs(R))}
  * [Shard(0)] -> [Partial(sum)]: {_us(0.0 + cs(S0))}
    [Shard(1)] -> [Shard(0)]: {_us(0.0 + cs(S1))}
    [Partial(sum)] -> [Partial(sum)]: {_us(0.0 + cs(PSUM))}
    [Partial(avg)] -> [Partial(avg)]: {_us(0.0 + cs(PAVG))}
  collectives: none
  result 0: [Partial(sum)] [6] Float""")
    return {k: v for k, v in out.items() if v[0] != v[1]}


def test_explain_golden(pool2):
    for failures in pool2.run(_case_explain_golden):
        for what, (got, want) in failures.items():
            assert got == want, f"{what}:\n--- got ---\n{got}\n--- want ---\n{want}"


def _case_explain_capture():
    m = mesh("1d2")
    x = vescale.distribute_tensor(torch.randn(4, 6), m, [Shard(1)])
    with vescale.explain.last(2) as e:
        y = torch.sin(x)
        z = y.sum()            # Shard(1) -> Partial: no collective
        torch.nonzero(x)       # no rule: the replicate fallback gathers
    fallback = e[-1]
    with vescale.explain.last(50) as whole:
        F.log_softmax(x, -1)   # over the split dim: composed of other DTensor ops
    decomposed = [d for d in whole if d.how == "decomposed"]
    parts = [d for d in whole if d.depth > 0]
    return {
        "kept": e.ops(),
        "fallback": (fallback.how, fallback.fallback_reason, [c["kind"] for c in fallback.collectives],
                     fallback.outputs[0]["placements"]),
        "fallback text": str(fallback).splitlines()[0].endswith("replicate fallback (no rule)"),
        "decomposed": [d.op for d in decomposed],
        "parts follow": bool(parts) and whole.decisions.index(parts[0]) > whole.decisions.index(decomposed[0]),
        "parts indented": all(str(d).startswith("  ") for d in parts),
        "z": z.placements,
    }


def test_explain_last_keeps_the_last_n_and_shows_fallbacks_and_decompositions(pool2):
    for res in pool2.run(_case_explain_capture):
        assert res["kept"] == ["aten::sum", "aten::nonzero"]  # the last 2 of sin, sum, nonzero
        assert res["fallback"] == ("fallback", "no rule", ["all_gather"], [("R",)])
        assert res["fallback text"]
        assert res["decomposed"] == ["aten::_log_softmax"]
        assert res["parts follow"] and res["parts indented"]
        assert res["z"] == (Partial(),)


def test_explain_errors():
    with pytest.raises(TypeError, match="explain.last"):
        vescale.explain("not a function")
    with pytest.raises(ValueError, match="positive int"):
        with vescale.explain.last(0):
            pass


# ---- visualize -------------------------------------------------------------------------------------

def _layouts(cases: dict) -> dict:
    out = {}
    for name, x in cases.items():
        buf = io.StringIO()
        vescale.debug.visualize(x, file=buf)
        out[name] = buf.getvalue()
    return out


def _case_visualize_1d():
    m = mesh("1d2")
    out = _layouts({
        "1d": vescale.distribute_tensor(torch.zeros(4, 6), m, [Shard(0)]),
        "interleaved": vescale.distribute_tensor(torch.zeros(6, 4), m, [InterleavedShard(0, 3)]),
        "uneven 1-d": vescale.distribute_tensor(torch.zeros(5), m, [Shard(0)]),
    })
    try:
        vescale.debug.visualize(torch.zeros(2))
    except TypeError as e:
        out["plain"] = str(e)
    return out


def _case_visualize_2d():
    m = mesh("2d")
    return _layouts({
        "2d": vescale.distribute_tensor(torch.zeros(4, 6), m, [Shard(0), Shard(1)]),
        "replicated rows": vescale.distribute_tensor(torch.zeros(4, 6), m, [Replicate(), Shard(0)]),
        "partial": vescale.DTensor.from_local(torch.zeros(4, 3), m, [Partial(), Shard(1)]),
    })


def test_visualize(pool2, pool4):
    mesh1 = "on a cpu mesh (TP=2)"
    mesh2 = "on a cpu mesh (DP=2, TP=2)"
    want = {
        # rows split in two: rank r holds rows 2r..2r+2, every column
        "1d": f"""\
DTensor of shape (4, 6) (float32) {mesh1}, placements (Shard(dim=0),)
  rank 0 at (0,): [0:2, 0:6]
  rank 1 at (1,): [2:4, 0:6]
  rows \\ cols  0:6
  0:2          rank 0
  2:4          rank 1
""",
        # DP splits rows, TP splits columns: a 2 x 2 grid of blocks in rank order
        "2d": f"""\
DTensor of shape (4, 6) (float32) {mesh2}, placements (Shard(dim=0), Shard(dim=1))
  rank 0 at (0, 0): [0:2, 0:3]
  rank 1 at (0, 1): [0:2, 3:6]
  rank 2 at (1, 0): [2:4, 0:3]
  rank 3 at (1, 1): [2:4, 3:6]
  rows \\ cols  0:3     3:6
  0:2          rank 0  rank 1
  2:4          rank 2  rank 3
""",
        # TP splits rows and DP replicates: ranks with the same TP coordinate share a block
        "replicated rows": f"""\
DTensor of shape (4, 6) (float32) {mesh2}, placements (Replicate(), Shard(dim=0))
  rank 0 at (0, 0): [0:2, 0:6]
  rank 1 at (0, 1): [2:4, 0:6]
  rank 2 at (1, 0): [0:2, 0:6]
  rank 3 at (1, 1): [2:4, 0:6]
  rows \\ cols  0:6
  0:2          ranks 0,2
  2:4          ranks 1,3
""",
        "partial": f"""\
DTensor of shape (4, 6) (float32) {mesh2}, placements (Partial(sum), Shard(dim=1))
  Partial on mesh dim 0: the sum-reduction over its ranks of their values is the tensor
  rank 0 at (0, 0): [0:4, 0:3] (a partial value)
  rank 1 at (0, 1): [0:4, 3:6] (a partial value)
  rank 2 at (1, 0): [0:4, 0:3] (a partial value)
  rank 3 at (1, 1): [0:4, 3:6] (a partial value)
  rows \\ cols  0:3        3:6
  0:4          ranks 0,2  ranks 1,3
""",
        # three blocks of two rows (q, k, v); rank r holds row r of each
        "interleaved": f"""\
DTensor of shape (6, 4) (float32) {mesh1}, placements (InterleavedShard(dim=0, groups=3),)
  rank 0 at (0,): [0:1, 0:4] + [2:3, 0:4] + [4:5, 0:4]
  rank 1 at (1,): [1:2, 0:4] + [3:4, 0:4] + [5:6, 0:4]
  rows \\ cols  0:4
  0:1          rank 0
  1:2          rank 1
  2:3          rank 0
  3:4          rank 1
  4:5          rank 0
  5:6          rank 1
""",
        # torch.chunk sizes: 3 then 2
        "uneven 1-d": f"""\
DTensor of shape (5,) (float32) {mesh1}, placements (Shard(dim=0),)
  rank 0 at (0,): [0:3]
  rank 1 at (1,): [3:5]
  rows \\ cols  :
  0:3          rank 0
  3:5          rank 1
""",
    }
    results = [{**a, **b} for a, b in zip(pool2.run(_case_visualize_1d) * 2, pool4.run(_case_visualize_2d))]
    for res in results:
        for name, text in want.items():
            assert res[name] == text, f"{name}:\n{res[name]}"
        assert "expects a DTensor, got a plain torch.Tensor" in res["plain"] and "distribute_tensor" in res["plain"]


# ---- check_replicas --------------------------------------------------------------------------------

class _TP(nn.Module):
    def __init__(self, mask=None):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.mask = mask
        self.op = None

    def forward(self, x):
        h = self.fc1(x)
        if self.op is not None:
            h = self.op(h, self.mask)
        return self.fc2(h)


_TP_PLAN = {"parameter": {r"fc1\.(weight|bias)": [Shard(0)], r"fc2\.weight": [Shard(1)]},
            "forward": {r"fc1\.input": [[Replicate()]], r"fc2\.output": [[Replicate()]]}}


def _tp_model(op=None):
    torch.manual_seed(0)
    # zero in the columns rank 1 holds of fc1's column-split output, one elsewhere
    mask = torch.cat([torch.ones(4, 8), torch.zeros(4, 8)], 1)
    net = _TP(mask)
    net.op = op
    parallelize_module(net, mesh("1d2"), _TP_PLAN)
    return net


def _case_check_replicas():
    net = _tp_model()
    out = {"clean": vescale.debug.check_replicas(net)}
    with torch.no_grad():
        if dist.get_rank() == 1:
            local_of(net.fc2.bias).add_(1e-6)  # one rank's replica drifts
    try:
        vescale.debug.check_replicas(net)
    except vescale.debug.ReplicaMismatchError as e:
        out["raised"] = str(e)
    out["listed"] = vescale.debug.check_replicas(net, raise_error=False)
    plain = torch.full((3,), float(dist.get_rank()))
    out["plain"] = vescale.debug.check_replicas({"w": plain}, group=dist.group.WORLD, raise_error=False)
    return out


def test_check_replicas_names_the_tensor_and_ranks_that_differ(pool2):
    for res in pool2.run(_case_check_replicas):
        assert res["clean"] == []
        assert "'fc2.bias' (Replicate on mesh dim TP of" in res["raised"]
        assert "rank 0 vs rank 1 hold different values" in res["raised"]
        assert len(res["listed"]) == 1 and res["listed"][0].startswith("'fc2.bias'")
        assert res["plain"] == ["'w' (the given group) differs across ranks: rank 0 vs rank 1 hold different values"]


def _case_check_replicas_ddp():
    model, _ = _dp_tp_model()
    clean = vescale.debug.check_replicas(model)
    with torch.no_grad():
        if dist.get_rank() == 2:
            model.module.head.weight.add_(1.0)
    try:
        vescale.debug.check_replicas(model)
        return clean, None
    except vescale.debug.ReplicaMismatchError as e:
        return clean, str(e)


def test_check_replicas_checks_ddp_replicas(pool4):
    for clean, raised in pool4.run(_case_check_replicas_ddp):
        assert clean == []
        # DP groups are {0, 2} and {1, 3}: only the first differs, and every rank hears of it
        assert raised is not None and "'module.head.weight' (DDP's data-parallel group)" in raised
        assert "rank 0 vs rank 2" in raised


# ---- NaN/Inf localisation --------------------------------------------------------------------------

def _masked_log(h, mask):
    return torch.log(h.abs() * mask)  # log(0) = -inf exactly where the mask is 0


def _masked_sqrt(h, mask):
    return torch.sqrt(h.abs() * mask)  # finite forward; the gradient of sqrt at 0 is inf


def _run_anomaly(op, **kwargs):
    net = _tp_model(op)
    try:
        with vescale.debug.detect_anomaly(**kwargs):
            net(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    except vescale.debug.AnomalyError as e:
        return str(e)
    return None


def _case_anomaly():
    out = {
        "forward": _run_anomaly(_masked_log),
        "backward": _run_anomaly(_masked_sqrt),
        "clean": _run_anomaly(None),
        "everywhere, at the op": _run_anomaly(lambda h, mask: torch.log(h * 0), sync=False),
    }
    # off again: a NaN outside the block raises nothing
    net = _tp_model(_masked_log)
    out["after"] = bool(torch.isnan(net(torch.randn(4, 8)).full_tensor()).any())
    return out


def test_detect_anomaly_finds_the_first_op_module_and_rank(pool2):
    for res in pool2.run(_case_anomaly):
        # Only rank 1 holds the masked columns: the log starts it there; every rank says so.
        assert res["forward"].startswith(
            "vescale.debug.detect_anomaly: aten::log produced a non-finite value (NaN or Inf) in its result 0 "
            "Spec([Shard(1)], shape=[4, 16], Float) on rank 1, in _TP (forward); its inputs were finite"), res
        # sqrt's backward is grad / (2 * sqrt(x)): the division by 0 on rank 1, in _TP's backward
        assert res["backward"].startswith(
            "vescale.debug.detect_anomaly: aten::div.Tensor produced a non-finite value (NaN or Inf) in its "
            "result 0 Spec([Shard(1)], shape=[4, 16], Float) on rank 1, in _TP (backward); its inputs were "
            "finite"), res
        assert res["clean"] is None
        assert res["everywhere, at the op"].startswith("vescale.debug.detect_anomaly: aten::log produced"), res
        assert res["after"] is True


# ---- bounded caches ----------------------------------------------------------------------------------

def _case_cache_bounds(limit: int, shapes: int):
    m = mesh("1d2")
    vescale.debug.set_decision_cache_limit(limit)
    vescale.debug.clear_cache()
    try:
        w = vescale.distribute_tensor(torch.ones(4, 3), m, [Replicate()])
        high = {"decisions": 0, "spec_table": 0}
        for n in range(1, shapes + 1):
            x = vescale.DTensor.from_local(torch.full((n, 4), 1.0), m, [Shard(0)], shape=(2 * n, 4),
                                           stride=(4, 1))
            y = (x + x) @ w  # a pointwise op and a matmul, both new for each shape
            if n % 500 == 0:
                sizes = vescale.debug.cache_sizes()
                for k in high:
                    high[k] = max(high[k], sizes[k])
        ok = torch.equal(y.to_local(), torch.full((shapes, 3), 8.0))
        sizes = vescale.debug.cache_sizes()
        return high, sizes, ok
    finally:
        vescale.debug.set_decision_cache_limit(None)


def test_caches_stay_bounded_over_10000_shapes(pool2):
    limit, shapes = 256, 10_000
    for high, sizes, ok in pool2.run(_case_cache_bounds, limit, shapes):
        assert ok
        assert sizes["decision_limit"] == limit
        assert high["decisions"] <= limit, high
        assert sizes["decision_evictions"] >= 2 * shapes // limit - 1  # two new decisions per shape
        # A decision holds at most 5 specs (2 sources, 2 targets, 1 result); the test holds
        # a handful more. Unheld specs are dropped: the table's live count stays near that...
        assert sizes["specs"] <= 5 * limit + 16, sizes
        # ...and its dead entries are swept before it doubles.
        assert high["spec_table"] <= 2 * (5 * limit + 16) + sizes["spec_sweep_min"], high
