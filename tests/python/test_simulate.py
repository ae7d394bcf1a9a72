"""vescale.debug.simulate: a program written for N ranks runs as N simulated ranks in this
one process (no torchrun) and gives the single-device results (TP+SP+ZeRO-2, and a
pipeline with its point-to-point sends); breakpoint() stops every rank at one place and
`ranks EXPR` looks at all of them; ranks that wait for each other forever, or disagree on
a collective, get an error naming each rank's call instead of a hang; the process is left
as it was found."""

import io
import random
import re
import sys

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale import Replicate, Shard, distribute_tensor
from vescale.debug import CollectiveMismatch, SimulatedDeadlock, simulate

from dist_utils import mismatch
from test_parallelize import _case_gpt


@pytest.mark.parametrize("name", ["dp2-tp2-sp-zero2", "pp2-tp2"])
def test_rfc_loop_on_simulated_ranks_matches_single_device(name):
    for losses, ref in simulate(_case_gpt, world_size=4, args=(name,)):
        assert mismatch(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6) is None, (losses, ref)


def _own_state():
    mesh = vescale.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(dist.get_rank())
    random.seed(dist.get_rank())
    draws = []
    for _ in range(3):  # the collective hands the baton around between the draws
        draws.append((torch.rand(2).tolist(), random.random()))
        dist.all_reduce(torch.ones(1))
    return draws, vescale.get_device_mesh() is mesh, mesh.get_coordinate()


def test_each_rank_has_its_own_generators_and_global_mesh():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    hook, excepthook = sys.breakpointhook, sys.excepthook
    results = simulate(_own_state, world_size=4)
    for rank, (draws, own_mesh, coordinate) in enumerate(results):
        g, py = torch.Generator().manual_seed(rank), random.Random(rank)
        assert draws == [(torch.rand(2, generator=g).tolist(), py.random()) for _ in range(3)]
        assert own_mesh and tuple(coordinate) == divmod(rank, 2)
    # the caller's process is as it was
    assert torch.equal(torch.get_rng_state(), before)
    assert not dist.is_initialized()
    assert sys.breakpointhook is hook and sys.excepthook is excepthook


def _stopped_in_the_middle():
    mesh = vescale.init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.arange(10.0), mesh, [Shard(0)])
    y = x * 2
    breakpoint()
    return y.sum().full_tensor().item()


def test_breakpoint_stops_every_rank_and_ranks_evaluates_on_all():
    commands = io.StringIO("ranks y.to_local()\nranks y.full_tensor().sum().item()\nranks nothing_here\nc\n")
    out = io.StringIO()
    assert simulate(_stopped_in_the_middle, world_size=4, debugger_stdin=commands, debugger_stdout=out) == [90.0] * 4
    text = out.getvalue()
    assert "-> breakpoint()" in text or "y.sum().full_tensor()" in text  # pdb shows where it stopped
    for rank, shard in enumerate(["[0., 2., 4.]", "[ 6.,  8., 10.]", "[12., 14., 16.]", "[18.]"]):
        assert f"[rank {rank}] tensor({shard})" in text, text
        assert f"[rank {rank}] 90.0" in text, text
        assert f"[rank {rank}] *** NameError" in text, text


def _one_rank_stops():
    mesh = vescale.init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if dist.get_rank() == 1:
        breakpoint()
    return x.full_tensor().sum().item()


def test_a_collective_typed_at_a_lone_breakpoint_fails_and_the_program_goes_on():
    # Ranks 0, 2, 3 wait in the program's all-gather; a full_tensor() typed at rank 1's
    # prompt must neither join that all-gather nor hang: it fails, and the program runs on.
    commands = io.StringIO("ranks x.to_local()\np x.full_tensor()\nc\n")
    out = io.StringIO()
    assert simulate(_one_rank_stops, world_size=4, debugger_stdin=commands, debugger_stdout=out) == [28.0] * 4
    text = out.getvalue()
    assert "[rank 1] tensor([2., 3.])" in text, text
    assert "[rank 0] not at this breakpoint (waits in all_gather_into_tensor" in text, text
    assert "SimulatedDeadlock" in text and "the program stays where it was" in text, text


def _rank0_reduces_alone():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))
    return dist.get_rank()


def test_a_collective_no_other_rank_joins_raises_instead_of_hanging():
    with pytest.raises(SimulatedDeadlock, match=r"rank 0: waits in all_reduce #1 of group .* \(1 of 4 ranks joined\)"):
        simulate(_rank0_reduces_alone, world_size=4)


def _ranks_disagree():
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def test_ranks_that_disagree_on_a_collective_get_both_calls_named():
    with pytest.raises(CollectiveMismatch, match=r"rank 0 called all_reduce .* rank 1 called broadcast"):
        simulate(_ranks_disagree, world_size=2)


def _rank2_fails():
    mesh = vescale.init_device_mesh("cpu", (4,))
    if dist.get_rank() == 2:
        raise ValueError("a bug on rank 2")
    return distribute_tensor(torch.ones(4), mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).full_tensor()


def test_a_failing_rank_raises_its_own_error_not_the_others_deadlock():
    with pytest.raises(ValueError, match="a bug on rank 2") as info:
        simulate(_rank2_fails, world_size=4)
    assert "simulated rank 2" in "".join(info.value.__notes__)


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        simulate(lambda: None, world_size=0)
    with pytest.raises(RuntimeError, match="already running"):  # a nested run, raised inside the outer one
        simulate(lambda: simulate(lambda: None, world_size=2), world_size=2)


def _gpt_stopped_inside_the_mlp():
    from examples.models.gpt import GPT, GPTConfig
    from vescale.parallel.plans import gpt_plan

    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    if dist.is_initialized():
        mesh = vescale.init_device_mesh("cpu", (4,))
        vescale.parallelize_module(model, mesh, gpt_plan())

    def stop_here(module, args):
        h = args[0]  # the MLP's hidden activation, as c_proj receives it
        if dist.is_initialized():
            breakpoint()
        else:
            return h.sum().item()

    seen = []
    model.transformer.h[1].mlp.c_proj.register_forward_pre_hook(lambda m, a: seen.append(stop_here(m, a)))
    model(x)
    return seen[0]


def test_breakpoint_inside_a_tensor_parallel_model_sees_every_shard():
    commands = io.StringIO("ranks tuple(h.to_local().shape), h.placements\nranks h.full_tensor().sum().item()\nc\n")
    out = io.StringIO()
    simulate(_gpt_stopped_inside_the_mlp, world_size=4, debugger_stdin=commands, debugger_stdout=out)
    text = out.getvalue()
    reference = _gpt_stopped_inside_the_mlp()  # the same model on one device
    for rank in range(4):
        assert f"[rank {rank}] ((2, 16, 32), (Shard(dim=2),))" in text, text  # 128 hidden units, 32 a rank
        value = float(re.search(rf"\[rank {rank}\] (-?[0-9.e+-]+)\n", text).group(1))
        assert value == pytest.approx(reference, rel=1e-5, abs=1e-4), (reference, text)
