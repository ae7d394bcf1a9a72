"""The public API around the engine: meshes, isinstance, parameters and their
gradients, in-place and view semantics, the replicate fallback and the cache."""

import warnings

import torch
import torch.distributed as dist

import vescale
from vescale import Partial, Replicate, Shard

from dist_utils import make_dtensor, mesh, mismatch, rand


def _case_mesh_api():
    m = mesh("2d")
    rank = dist.get_rank()
    out = {
        "strategy_sizes": (m.get_strategy_size("DP"), m.get_strategy_size("TP")),
        "coordinate": m.get_coordinate(),
        "coordinate_of": [m.coordinate_of(r) for r in range(4)],
        "rank_at": m.rank_at((1, 0)),
        "submeshes_TP": m.submeshes("TP"),
        "submeshes_DP": m.submeshes("DP"),
        "tp_mesh": (m["TP"].mesh.tolist(), m["TP"].mesh_dim_names, m["TP"].get_local_rank()),
        "local_rank_DP": m.get_local_rank("DP"),
        "size": (m.size(), m.ndim, m.shape),
    }
    g = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    out["global"] = vescale.get_device_mesh() is g
    # a DTensor on the TP sub-mesh computes on its own
    tp = m["TP"]
    x = vescale.distribute_tensor(rand((4, 4), seed=1), tp, [Shard(0)])
    out["sub_mesh_op"] = mismatch((x @ x).full_tensor(), rand((4, 4), seed=1) @ rand((4, 4), seed=1))
    out["rank"] = rank
    return out


def test_mesh_api(pool4):
    for res in pool4.run(_case_mesh_api):
        r = res["rank"]
        assert res["strategy_sizes"] == (2, 2)
        assert res["coordinate"] == (r // 2, r % 2)
        assert res["coordinate_of"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert res["rank_at"] == 2
        assert res["submeshes_TP"] == [[0, 1], [2, 3]]
        assert res["submeshes_DP"] == [[0, 2], [1, 3]]
        assert res["tp_mesh"] == ([2 * (r // 2), 2 * (r // 2) + 1], ("TP",), r % 2)
        assert res["local_rank_DP"] == r // 2
        assert res["size"] == (4, 2, (2, 2))
        assert res["global"] is True
        assert res["sub_mesh_op"] is None


def _case_dtensor_identity_and_params():
    m = mesh("1d4")
    x = vescale.distribute_tensor(rand((8, 6), seed=1), m, [Shard(0)])
    y = x + 1
    w = torch.nn.Parameter(vescale.distribute_tensor(rand((6, 5), seed=2), m, [Shard(1)]))
    checks = {
        "distribute result": isinstance(x, vescale.DTensor),
        "op result": isinstance(y, vescale.DTensor),
        "plain tensor": not isinstance(torch.ones(2), vescale.DTensor),
        "parameter": isinstance(w, torch.nn.Parameter) and isinstance(w, vescale.DTensor),
        "placements": y.placements == (Shard(0),),
        "mesh": y.device_mesh == m,
        "repr": "DTensor(local_tensor=" in repr(y) and "Shard(dim=0)" in repr(y),
        "shape": tuple(y.shape) == (8, 6) and tuple(y.to_local().shape) == (2, 6),
    }
    # A column-split weight: its gradient comes back in its own placements.
    (x @ w).pow(2).sum().backward()
    ref_x, ref_w = rand((8, 6), seed=1), rand((6, 5), seed=2).requires_grad_()
    (ref_x @ ref_w).pow(2).sum().backward()
    checks["grad placements"] = w.grad.placements == (Shard(1),)
    checks["grad values"] = mismatch(w.grad.full_tensor(), ref_w.grad) is None
    opt = torch.optim.AdamW([w], lr=0.1)
    opt.step()
    checks["optimizer keeps placements"] = w.placements == (Shard(1),) and isinstance(w, vescale.DTensor)
    return {k: v for k, v in checks.items() if v is not True}


def test_dtensor_identity_and_params(pool4):
    for failures in pool4.run(_case_dtensor_identity_and_params):
        assert failures == {}


def _case_python_tensor_methods():
    """Tensor methods written in Python or C++ outside the dispatcher: the ones that take
    a device from the tensor's dispatch key (new_tensor, new) and deepcopy, which copies
    storage. A torchtitan-style init (nn.init.trunc_normal_ calls new_tensor) of a
    sharded parameter must give the single-device values."""
    import copy

    m = mesh("2d")
    checks = {}
    x = make_dtensor(rand((5, 6), seed=1), m, [Shard(0), Shard(1)])
    t = x.new_tensor([1.0, 2.0])
    checks["new_tensor"] = (not isinstance(t, vescale.DTensor) and t.dtype == x.dtype and t.tolist() == [1.0, 2.0])
    checks["new"] = tuple(x.new(3).shape) == (3,) and not isinstance(x.new(3), vescale.DTensor)

    w = torch.nn.Parameter(make_dtensor(torch.zeros(9, 7, dtype=torch.float64), m, [Shard(0), Shard(1)]))
    torch.manual_seed(5)
    torch.nn.init.trunc_normal_(w, std=0.02, a=-0.03, b=0.03)  # rejection rounds (bounds at 1.5 std)
    ref = torch.zeros(9, 7, dtype=torch.float64)
    torch.manual_seed(5)
    torch.nn.init.trunc_normal_(ref, std=0.02, a=-0.03, b=0.03)
    checks["trunc_normal_"] = w.placements == (Shard(0), Shard(1)) and mismatch(w.full_tensor(), ref) is None

    y = make_dtensor(rand((5, 6), seed=2), m, [Shard(1), Replicate()]).requires_grad_()
    (y * 3).sum().backward()
    y.tag = {"note": [1]}
    z = copy.deepcopy(y)
    checks["deepcopy"] = (z is not y and z.placements == y.placements and z.requires_grad and z.is_leaf
                          and mismatch(z.full_tensor(), y.full_tensor()) is None
                          and mismatch(z.grad.full_tensor(), y.grad.full_tensor()) is None
                          and z.tag == y.tag and z.tag is not y.tag)
    with torch.no_grad():
        z.add_(1)
    checks["deepcopy owns its data"] = mismatch(y.full_tensor(), rand((5, 6), seed=2)) is None
    model = torch.nn.Linear(6, 4).double()
    model.weight = torch.nn.Parameter(make_dtensor(rand((4, 6), seed=3), m, [Shard(0), Replicate()]))
    twin = copy.deepcopy(model)
    inp = make_dtensor(rand((3, 6), seed=4), m, [Replicate(), Replicate()])
    checks["deepcopy of a module"] = (twin.weight is not model.weight and twin.weight.placements == (Shard(0), Replicate())
                                      and mismatch(twin(inp).full_tensor(), model(inp).full_tensor()) is None)
    vescale.reset_fallback_counts()
    checks["is_pinned asks the shard"] = w.is_pinned() is False and vescale.fallback_counts() == {}
    # detach and alias share the shards, whatever the placements: detach of a Partial max
    # (or of mixed Partials) was reduced into a new tensor, so a checkpoint loaded through
    # it, or any write through it, did not reach the tensor (stop 39)
    for name, make_alias in (("detach", torch.Tensor.detach), ("alias", torch.ops.aten.alias)):
        p = make_dtensor(rand((4, 3), seed=5), m, [Partial(), Partial("max")], seed=5)
        alias = make_alias(p)
        same = alias.placements == p.placements and alias.to_local().data_ptr() == p.to_local().data_ptr()
        alias.mul_(2.0)
        checks[f"{name} of a Partial max shares its shards"] = same and mismatch(p.full_tensor(), 2 * rand((4, 3), seed=5)) is None
    return {k: v for k, v in checks.items() if v is not True}


def test_python_tensor_methods(pool4):
    for failures in pool4.run(_case_python_tensor_methods):
        assert failures == {}


def _case_user_grad_hooks():
    """Tensor hooks of the user's on DTensor leaves fire, see the gradient in the leaf's
    placements and change it, whether registered before or after the leaf's first op
    (vescale's own gradient hook once replaced the user's Python hooks, or was replaced
    by them). Also on a tensor-parallel GPT, against the same hooks on one device."""
    from examples.models.gpt import GPT, GPTConfig
    from vescale.parallel import parallelize_module
    from vescale.parallel.plans import gpt_plan

    m = mesh("2d")
    a, b = rand((6, 8), seed=1), rand((8, 5), seed=2)
    failures = {}
    for when in ("before", "after"):
        x = make_dtensor(a, m, [Shard(1), Replicate()])  # the contraction dim split: w's gradient is Partial
        w = make_dtensor(b, m, [Replicate(), Shard(1)]).requires_grad_()
        seen = []

        def hook(g, seen=seen):
            seen.append(g.placements)
            return g * 3
        if when == "after":
            (x @ w).sum()  # the leaf's first op, without backward
        handle = w.register_hook(hook)
        (x @ w).tanh().sum().backward()
        ref = b.clone().requires_grad_()
        (a @ ref).tanh().sum().backward()
        if seen != [w.placements]:
            failures[f"{when}: hook saw"] = seen
        if w.grad.placements != w.placements or mismatch(w.grad.full_tensor(), 3 * ref.grad) is not None:
            failures[f"{when}: grad"] = (w.grad.placements, mismatch(w.grad.full_tensor(), 3 * ref.grad))
        handle.remove()
        w.grad = None
        (x @ w).tanh().sum().backward()
        if len(seen) != 1 or mismatch(w.grad.full_tensor(), ref.grad) is not None:
            failures[f"{when}: removed hook"] = len(seen)

    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for parallel in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(bias=False)).double()
        if parallel:
            parallelize_module(model, mesh("1d4"), gpt_plan())
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-1e-3, 1e-3))  # nonlinear: must see the whole gradient
        model(idx, idx).backward()
        grads.append({n: p.grad.full_tensor() if parallel else p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        if (bad := mismatch(grads[1][n], g, rtol=1e-6, atol=1e-9)) is not None:
            failures[f"gpt {n}"] = bad
    return failures


def test_user_grad_hooks_fire_on_dtensor_leaves(pool4):
    for failures in pool4.run(_case_user_grad_hooks):
        assert failures == {}


def _case_double_backward():
    """A gradient penalty (``autograd.grad`` with ``create_graph``, then the gradient of a
    function of that gradient) through every place where vescale moves a gradient itself:
    a Partial leaf's hook (its gradient arrives Partial and leaves Replicate),
    ``redistribute``'s backward, and ``to_local`` / ``from_local``'s. Before, each moved
    the gradient outside autograd: the first gradient came back without a graph and the
    second missed every term through it (silently)."""
    m = mesh("2d")
    a = rand((4, 6), seed=1)
    paths = {  # name: (placements of x, f(x) on DTensors, the same on plain tensors)
        "partial leaf": ([Partial(), Replicate()], lambda x: torch.sin(x) * x, lambda x: torch.sin(x) * x),
        "redistribute": ([Replicate(), Shard(0)], lambda x: torch.sin(x.redistribute(m, [Shard(1), Partial()])) * x,
                         lambda x: torch.sin(x) * x),
        "local round trip": ([Shard(0), Shard(1)],
                             lambda x: vescale.DTensor.from_local(x.to_local().exp(), m, x.placements) * x,
                             lambda x: x.exp() * x),
    }
    failures = {}
    for name, (placements, f, f_plain) in paths.items():
        results = []
        for x, fn in ((make_dtensor(a, m, placements), f), (a.clone(), f_plain)):
            x.requires_grad_()
            (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad((g * g.cos()).sum(), x)
            results.append([t.full_tensor() if isinstance(t, vescale.DTensor) else t for t in (g.detach(), gg)])
        for what, got, want in zip(("gradient", "second gradient"), *results):
            if (bad := mismatch(got, want, rtol=1e-12, atol=1e-12)) is not None:
                failures[f"{name}: {what}"] = bad
    return failures


def test_double_backward_matches_single_device(pool4):
    for failures in pool4.run(_case_double_backward):
        assert failures == {}


def _case_inplace_views_and_plain():
    m = mesh("2d")
    a, b = rand((4, 6), seed=1), rand((4, 6), seed=2)
    failures = {}
    with torch.no_grad():
        # in-place keeps the written tensor's placements, whatever the other's
        for pa in ([Shard(0), Replicate()], [Replicate(), Shard(1)], [Partial(), Shard(0)]):
            for pb in ([Replicate(), Replicate()], [Shard(1), Partial()], [Shard(0), Shard(0)]):
                x, y = make_dtensor(a, m, pa), make_dtensor(b, m, pb)
                x.add_(y).mul_(2).relu_()
                if list(x.placements) != pa or mismatch(x.full_tensor(), ((a + b) * 2).relu()):
                    failures[f"inplace {pa} {pb}"] = x.placements
        # writes through a view reach the base
        x = make_dtensor(a, m, [Shard(0), Replicate()])
        v = x.view(2, 2, 6)
        v.mul_(3)
        if mismatch(x.full_tensor(), a * 3):
            failures["write through view"] = True
        # out= variant
        x, y = make_dtensor(a, m, [Shard(0), Replicate()]), make_dtensor(b, m, [Replicate(), Shard(1)])
        out = make_dtensor(torch.zeros(4, 6, dtype=a.dtype), m, [Replicate(), Replicate()])
        torch.add(x, y, out=out)
        if list(out.placements) != [Replicate(), Replicate()] or mismatch(out.full_tensor(), a + b):
            failures["out="] = out.placements
        # a plain tensor meeting a DTensor is replicated
        x = make_dtensor(a, m, [Shard(0), Shard(1)])
        if mismatch((x * b).full_tensor(), a * b) or mismatch((b - x).full_tensor(), b - a):
            failures["plain operand"] = True
        # dtype conversion, clone and detach keep the layout
        z = x.to(torch.float32).clone().detach()
        if z.placements != x.placements or z.dtype != torch.float32 or mismatch(z.full_tensor(), a.float()):
            failures["to/clone/detach"] = z.placements
    return failures


def test_inplace_views_and_plain(pool4):
    for failures in pool4.run(_case_inplace_views_and_plain):
        assert failures == {}


def _case_fallback_is_counted_and_correct():
    m = mesh("1d4")
    a = rand((5, 6), seed=3)
    x = make_dtensor(a, m, [Shard(1)])
    vescale.reset_fallback_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.trace(x)  # an op without a sharding rule
        second = torch.trace(x)
    counts = vescale.fallback_counts()
    messages = [str(w.message) for w in caught if "aten::trace" in str(w.message)]
    return {
        "values": mismatch(first.full_tensor(), torch.trace(a)) is None
        and mismatch(second.full_tensor(), torch.trace(a)) is None,
        "count": counts.get("aten::trace"),
        "warned_once": len(messages) <= 1,  # warned on first use (maybe in an earlier case)
        "report": any(op == "aten::trace" for op, _, _ in vescale.debug.fallback_report()),
    }


def test_fallback_is_counted_and_correct(pool4):
    for res in pool4.run(_case_fallback_is_counted_and_correct):
        assert res == {"values": True, "count": 2, "warned_once": True, "report": True}


def _case_warm_loop_has_no_cache_misses():
    m = mesh("2d")
    x = vescale.distribute_tensor(rand((8, 6), seed=1), m, [Shard(0), Replicate()]).requires_grad_()
    w = vescale.distribute_tensor(rand((6, 4), seed=2), m, [Replicate(), Shard(1)]).requires_grad_()

    def step():
        loss = torch.nn.functional.gelu(x @ w).sum()
        loss.backward()
        return loss

    step()
    step()  # the second backward accumulates into existing .grad: new ops, new decisions
    before = vescale.debug.cache_misses()
    for _ in range(3):
        step()
    return vescale.debug.cache_misses() - before


def test_warm_loop_has_no_cache_misses(pool4):
    assert pool4.run(_case_warm_loop_has_no_cache_misses) == [0, 0, 0, 0]


def _case_inplace_on_views_with_autograd():
    """Autograd re-creates views written in place (CopySlices, with as_strided)."""
    m = mesh("2d")
    a, g = rand((4, 6), seed=1), rand((4, 6), seed=2)
    failures = {}
    for p in ([Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Replicate()]):
        x = make_dtensor(a, m, p, requires_grad=True)
        y = x * 1
        y[:, 2] = 0.0
        y.view(-1).mul_(2)
        (y * make_dtensor(g, m, [Replicate(), Replicate()])).sum().backward()
        ref_x = a.clone().requires_grad_()
        ref_y = ref_x * 1
        ref_y[:, 2] = 0.0
        ref_y.view(-1).mul_(2)
        (ref_y * g).sum().backward()
        err = mismatch(y.full_tensor(), ref_y.detach()) or mismatch(x.grad.full_tensor(), ref_x.grad)
        if err:
            failures[str(p)] = err
    return failures


def test_inplace_on_views_with_autograd(pool4):
    for failures in pool4.run(_case_inplace_on_views_with_autograd):
        assert failures == {}


def _case_mesh_dims_of_one_rank():
    """On a (2, 1) mesh the "TP" dim has one rank: every placement there is Replicate (the
    same data), so a loss over classes "split" on it is plain torch's (no vocabulary-parallel
    composition) and moving along it costs no collective."""
    m = vescale.DeviceMesh("cpu", torch.arange(2).reshape(2, 1), mesh_dim_names=("DP", "TP"))
    logits, target = rand((6, 10), seed=1), torch.arange(6) % 10
    x = vescale.distribute_tensor(logits.clone(), m, [Shard(0), Shard(1)]).requires_grad_()
    out = {"placements": [str(p) for p in x.placements],
           "partial": [str(p) for p in vescale.DTensor.from_local(torch.ones(2), m, [Replicate(), Partial()]).placements]}
    vescale.reset_collective_counts()
    y = x.redistribute(placements=[Shard(0), Replicate()]).redistribute(placements=[Shard(0), Shard(0)])
    out["moves"] = {k: v for k, v in vescale.collective_counts().items() if v != (0, 0)}
    out["same"] = mismatch(y.full_tensor(), logits)
    loss = torch.nn.functional.cross_entropy(x, target)
    loss.backward()
    ref = logits.clone().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(ref, target)
    ref_loss.backward()
    out["loss"] = mismatch(loss.full_tensor(), ref_loss)
    out["grad"] = mismatch(x.grad.full_tensor(), ref.grad)
    return out


def test_mesh_dims_of_one_rank_are_replicate(pool2):
    for res in pool2.run(_case_mesh_dims_of_one_rank):
        assert res["placements"] == ["Shard(dim=0)", "Replicate()"]
        assert res["partial"] == ["Replicate()", "Replicate()"]
        assert res["moves"] == {}
        assert res["same"] is res["loss"] is res["grad"] is None
