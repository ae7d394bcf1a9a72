"""torch.compile on vescale-parallel models: Dynamo graph-breaks at DTensor regions,
which run eagerly through vescale's dispatcher; code on plain tensors still compiles.
Compiled runs (backends "eager" and "inductor") train like the uncompiled parallel run
and like single-device training, and the process warns once (vescale/_compile.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vescale
from vescale import Replicate, Shard
from vescale.parallel import parallelize_module
from vescale.parallel.plans import gpt_plan

from dist_utils import full_grads, mesh, mismatch, mismatch_to_max
from examples.models.gpt import GPT, GPTConfig

STEPS = 3
LR = 0.1
WARNING = "vescale: torch.compile runs code that touches vescale DTensors eagerly"


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, vescale.DTensor) else t).detach()


class _Recorder:
    """A Dynamo backend that hands each graph to ``backend`` and keeps it, to see what compiled."""

    def __init__(self, backend: str):
        self.inner = torch._dynamo.lookup_backend(backend)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)

    def calls(self, name: str) -> int:
        return sum(1 for g in self.graphs for n in g.graph.nodes
                   if n.op == "call_function" and name in str(n.target))


def _vescale_graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(n for msg, n in counters["unimplemented"].items() if msg.startswith("vescale DTensor"))


def _train(model: nn.Module, forward, batches) -> dict:
    """Logits before training, then per SGD step the loss and every gradient; the
    parameters at the end. Everything as whole plain tensors."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"losses": [], "grads": []}
    with torch.no_grad():
        out["logits"] = _full(forward(batches[0][0]))
    for x, y in batches:
        opt.zero_grad()
        loss = forward(x, y)
        loss.backward()
        out["losses"].append(_full(loss).item())
        out["grads"].append(full_grads(model))
        opt.step()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _mismatches(got: dict, ref: dict, what: str) -> list[str]:
    failures = []
    err = mismatch(got["logits"], ref["logits"], rtol=1e-5, atol=1e-6)
    if err:
        failures.append(f"{what}: logits: {err}")
    err = mismatch(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    if err:
        failures.append(f"{what}: losses {got['losses']} vs {ref['losses']}: {err}")
    for step, (grads, ref_grads) in enumerate(zip(got["grads"], ref["grads"])):
        for name, g in grads.items():
            err = mismatch_to_max(g, ref_grads[name])
            if err:
                failures.append(f"{what}: step {step} gradient of {name}: {err}")
    for name, p in got["params"].items():
        err = mismatch_to_max(p, ref["params"][name])
        if err:
            failures.append(f"{what}: parameter {name} after {STEPS} SGD steps: {err}")
    return failures


# ---- the GPT under TP2 ----------------------------------------------------------------

def _gpt_batches():
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 64, (4, 17), generator=g) for _ in range(STEPS)]
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _gpt(parallel: bool) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(bias=False))  # no biases: see test_parallel (attention's key bias)
    if parallel:
        parallelize_module(model, mesh("1d2"), gpt_plan())
    return model


def _case_gpt(backend: str):
    torch._dynamo.reset()
    batches = _gpt_batches()
    single = _train(m := _gpt(False), m, batches)
    eager = _train(m := _gpt(True), m, batches)
    model = _gpt(True)
    recorder = _Recorder(backend)
    compiled = _train(model, torch.compile(model, backend=recorder), batches)
    failures = _mismatches(compiled, eager, "compiled vs uncompiled TP2") + \
        _mismatches(compiled, single, "compiled TP2 vs single device")
    if _vescale_graph_breaks() == 0:
        failures.append("no graph break at a DTensor region was recorded")
    if not recorder.graphs:
        failures.append("nothing was compiled")
    return failures


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_gpt_tp2_compiled_matches_eager_and_single_device(pool2, backend):
    for failures in pool2.run(_case_gpt, backend, timeout=600):
        assert not failures, "\n".join(failures)


# ---- a model with only one parallel part: the rest still compiles ------------------------

class _HalfParallel(nn.Module):
    """A plain front (compiled) feeding a tensor-parallel MLP (eager) and the loss."""

    def __init__(self):
        super().__init__()
        self.front = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x, y=None):
        out = self.mlp(self.front(x))
        return out if y is None else F.mse_loss(out, y)


_MLP_PLAN = {
    "parameter": {r"0\.(weight|bias)": [Shard(0)], r"2\.weight": [Shard(1)]},
    "forward": {r"0\.input": [[Replicate()]], r"2\.output": [[Replicate()]]},
}


def _half(parallel: bool) -> nn.Module:
    torch.manual_seed(0)
    model = _HalfParallel()
    if parallel:
        parallelize_module(model.mlp, mesh("1d2"), _MLP_PLAN)
    return model


def _case_half(backend: str):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]
    single = _train(m := _half(False), m, batches)
    eager = _train(m := _half(True), m, batches)
    model = _half(True)
    recorder = _Recorder(backend)
    compiled = _train(model, torch.compile(model, backend=recorder), batches)
    failures = _mismatches(compiled, eager, "compiled vs uncompiled") + \
        _mismatches(compiled, single, "compiled vs single device")
    if recorder.calls("linear") < 2:  # the front's two Linears, in the graphs Dynamo compiled
        failures.append(f"the plain front was not compiled: graphs {[str(g.graph) for g in recorder.graphs]}")
    if not all(isinstance(p, vescale.DTensor) for p in model.mlp.parameters()):
        failures.append("the MLP's parameters are not DTensors")
    return failures


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_plain_parts_compile_around_a_parallel_module(pool2, backend):
    for failures in pool2.run(_case_half, backend, timeout=600):
        assert not failures, "\n".join(failures)


# ---- one warning per process; fullgraph and FakeTensorMode refuse clearly ------------------

def _case_warning():
    from vescale import _compile
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedFakeTensorException

    torch._dynamo.reset()
    _compile._warned = False  # earlier cases in this rank may have warned already
    batches = _gpt_batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two compiled models, each called twice
            compiled = torch.compile(_gpt(True), backend="eager")
            for x, y in batches[:2]:
                compiled(x, y).backward()
    ours = [str(w.message) for w in caught if WARNING in str(w.message)]
    others = [f"{w.category.__name__}: {w.message}" for w in caught  # Dynamo's own, about vescale code
              if WARNING not in str(w.message) and ("vescale" in str(w.message) or "Dynamo" in str(w.message))]
    failures = []
    if len(ours) != 1:
        failures.append(f"expected one vescale warning, got {len(ours)}")
    elif "graph break" not in ours[0] or "eager" not in ours[0]:
        failures.append(f"the warning does not say what happens: {ours[0]}")
    if others:
        failures.append(f"other warnings about vescale or from Dynamo: {others}")

    torch._dynamo.reset()
    try:
        torch.compile(_gpt(True), backend="eager", fullgraph=True)(*batches[0])
        failures.append("fullgraph=True compiled a model holding DTensors")
    except torch._dynamo.exc.Unsupported as e:
        if "vescale DTensor" not in str(e):
            failures.append(f"fullgraph=True raised without naming vescale DTensors: {e}")

    dt = vescale.distribute_tensor(torch.randn(4, 4), mesh("1d2"), [Shard(0)])
    try:
        FakeTensorMode().from_tensor(dt)
        failures.append("FakeTensorMode made a fake of a DTensor")
    except UnsupportedFakeTensorException as e:
        if "DTensor" not in str(e):
            failures.append(f"FakeTensorMode's error does not name the DTensor: {e}")
    return failures


def test_warns_once_and_refuses_fullgraph(pool2):
    for failures in pool2.run(_case_warning, timeout=600):
        assert not failures, "\n".join(failures)
