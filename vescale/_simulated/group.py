"""A torch.distributed backend whose ranks are threads of one process (the simulated
ranks of ``vescale.debug.simulate``). A collective's data moves by plain tensor copies:
the last rank to join does the whole collective for everyone; the others wait through
the scheduler, which lets the remaining ranks run meanwhile. Sends are buffered; a
receive waits for its message. Ranks that disagree on a group's next collective get an
error naming both calls, where a real backend would hang or mix up the data."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import ReduceOp
from torch.futures import Future

from .scheduler import Scheduler, SimulatedDeadlock

BACKEND = "vescale_sim"


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives (or the same one with other shapes) as their
    n-th call on a group."""


def _done_work(result=None):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _reduce(tensors: list[torch.Tensor], op) -> torch.Tensor:
    """Reduces in rank order, so every rank gets the same bits."""
    kind = op.op if hasattr(op, "op") else op
    stacked = torch.stack([t.detach() for t in tensors])
    if kind == ReduceOp.SUM:
        return stacked.sum(0).to(tensors[0].dtype)
    if kind == ReduceOp.AVG:
        return stacked.mean(0) if stacked.is_floating_point() else stacked.sum(0) // len(tensors)
    if kind == ReduceOp.PRODUCT:
        return stacked.prod(0).to(tensors[0].dtype)
    if kind == ReduceOp.MIN:
        return stacked.amin(0)
    if kind == ReduceOp.MAX:
        return stacked.amax(0)
    bitwise = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}
    if kind in bitwise:
        out = tensors[0].detach()
        for t in tensors[1:]:
            out = bitwise[kind](out, t.detach())
        return out
    raise NotImplementedError(f"simulated ranks: reduce op {kind} is not supported (SUM, AVG, PRODUCT, MIN, MAX "
                              f"and the bitwise ones are)")


def _put(dst: torch.Tensor, value: torch.Tensor) -> None:
    # Collectives write their outputs in place; autograd is not to see that (torch's
    # backends bypass it too), hence detach.
    dst.detach().copy_(value.reshape(dst.shape))


@dataclass
class _Call:
    """The n-th collective of a group: what each rank brought, until all have."""
    kind: str
    size: int
    signature: object
    data: dict = field(default_factory=dict)
    done: bool = False
    error: BaseException | None = None


class World:
    """What the simulated ranks share: collectives in progress and undelivered messages."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.calls: dict[tuple[str, int], _Call] = {}
        self.mailboxes: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)


class _RecvWork(dist.Work):
    def __init__(self, group: "SimulatedGroup", box: collections.deque, tensors, what: str):
        super().__init__()
        self._group, self._box, self._tensors, self._what = group, box, tensors, what
        self._received = False

    def wait(self, timeout=None) -> bool:
        if not self._received:
            self._group._world.scheduler.wait_until(lambda: len(self._box) > 0, lambda: self._what)
            with torch.no_grad():
                for dst, src in zip(self._tensors, self._box.popleft()):
                    _put(dst, src)
            self._received = True
        return True

    def is_completed(self) -> bool:
        return self._received


class SimulatedGroup(dist.ProcessGroup):
    def __init__(self, world: World, rank: int, size: int):
        super().__init__(rank, size)
        self._world = world
        self._calls_made = 0
        self._command_calls = [None, 0]  # (command id, calls in it)
        self._name = self._desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch names a group after creating it; a Python group keeps the name itself (the
    # base class would hand it to backends this group does not have).
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_desc(self) -> str:
        return self._desc

    # -- one collective, whatever its kind --------------------------------------------

    def _collective(self, kind: str, payload, work, signature=None):
        """Joins this group's next collective; the last rank to join runs ``work`` on the
        payloads of all ranks (in group-rank order)."""
        name = self.group_name
        world, me = self._world, self.rank()
        key = self._next_key(name)
        call = world.calls.get(key)
        if call is None:
            call = world.calls[key] = _Call(kind, self.size(), signature)
        elif call.error is None and (call.kind, call.signature) != (kind, signature):
            first = min(call.data)
            call.error = CollectiveMismatch(
                f"simulated ranks disagree on collective #{key[-1]} of group {name!r}: rank {first} called "
                f"{call.kind}{_show(call.signature)}, rank {me} called {kind}{_show(signature)}; every rank "
                f"of a group must issue the same collectives in the same order")
        call.data[me] = payload
        if len(call.data) == call.size:
            world.calls.pop(key)
            if call.error is None:
                try:
                    with torch.no_grad():
                        work([call.data[i] for i in range(call.size)])
                except Exception as e:  # noqa: BLE001 (every rank of the call gets it)
                    call.error = e
                call.done = True
        elif call.error is None:
            try:
                world.scheduler.wait_until(
                    lambda: call.done or call.error is not None,
                    lambda: f"{kind} {_which(key)} of group {name!r} ({len(call.data)} of {call.size} ranks joined)")
            except SimulatedDeadlock:
                self._withdraw(key, call, me)
                raise
        if call.error is not None:
            raise _for_this_rank(call.error)
        return _done_work()

    def _next_key(self, name: str) -> tuple:
        """Which call of the group this is. A debugger command's collectives are counted
        apart from the program's: they match only the same command on other ranks, never
        a collective the program has in flight."""
        scheduler = self._world.scheduler
        if scheduler.rank() in scheduler.interactive:
            if self._command_calls[0] != scheduler.command_id:
                self._command_calls = [scheduler.command_id, 0]
            self._command_calls[1] += 1
            return (name, "command", scheduler.command_id, self._command_calls[1])
        self._calls_made += 1
        return (name, self._calls_made)

    def _withdraw(self, key, call: _Call, me: int) -> None:
        """A debugger command's collective that could not complete leaves no trace."""
        call.data.pop(me, None)
        if not call.data:
            self._world.calls.pop(key, None)

    # -- collectives (the methods torch's Python ProcessGroup trampoline calls) ---------

    def allreduce(self, tensors, opts=None):
        def work(per_rank):
            for i in range(len(tensors)):
                total = _reduce([ts[i] for ts in per_rank], opts.reduceOp)
                for ts in per_rank:
                    _put(ts[i], total)
        return self._collective("all_reduce", tensors, work, _shapes(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def barrier(self, opts=None):
        return self._collective("barrier", None, lambda per_rank: None)

    def allgather(self, outputs, inputs, opts=None):
        def work(per_rank):
            for i in range(len(inputs)):
                for outs, _ in per_rank:
                    for src, dst in enumerate(outs[i]):
                        _put(dst, per_rank[src][1][i])
        return self._collective("all_gather", (outputs, inputs), work, _shapes(inputs))

    def all_gather_single(self, output, input, opts=None):
        def work(per_rank):
            whole = torch.cat([x.detach().reshape(-1) for _, x in per_rank])
            for out, _ in per_rank:
                _put(out, whole)
        return self._collective("all_gather_into_tensor", (output, input), work, _shapes([input]))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _done_work()

    def reduce_scatter(self, outputs, inputs, opts=None):
        def work(per_rank):
            for i in range(len(outputs)):
                for dst_rank, (outs, _) in enumerate(per_rank):
                    _put(outs[i], _reduce([ins[i][dst_rank] for _, ins in per_rank], opts.reduceOp))
        return self._collective("reduce_scatter", (outputs, inputs), work, _shapes(outputs))

    def reduce_scatter_single(self, output, input, opts=None):
        def work(per_rank):
            n = len(per_rank)
            chunks = [x.detach().reshape(n, -1) for _, x in per_rank]
            for dst_rank, (out, _) in enumerate(per_rank):
                _put(out, _reduce([c[dst_rank] for c in chunks], opts.reduceOp))
        return self._collective("reduce_scatter_tensor", (output, input), work, _shapes([input]))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _done_work()

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        def work(per_rank):
            n = len(per_rank)
            pieces = []
            for _, x, _, splits in per_rank:
                sizes = list(splits) if splits else [x.shape[0] // n] * n
                pieces.append(torch.split(x.detach(), sizes))
            for dst_rank, (out, _, _, _) in enumerate(per_rank):
                _put(out, torch.cat([p[dst_rank] for p in pieces]))
        return self._collective("all_to_all_single", (output, input, output_splits, input_splits), work)

    def alltoall(self, outputs, inputs, opts=None):
        def work(per_rank):
            for dst_rank, (outs, _) in enumerate(per_rank):
                for src_rank, (_, ins) in enumerate(per_rank):
                    _put(outs[src_rank], ins[dst_rank])
        return self._collective("all_to_all", (outputs, inputs), work)

    def broadcast(self, tensors, opts=None):
        def work(per_rank):
            for i in range(len(tensors)):
                for ts in per_rank:
                    _put(ts[i], per_rank[opts.rootRank][i])
        return self._collective("broadcast", tensors, work, (_shapes(tensors), opts.rootRank))

    def scatter(self, outputs, inputs, opts=None):
        def work(per_rank):
            root_inputs = per_rank[opts.rootRank][1]
            for dst_rank, (outs, _) in enumerate(per_rank):
                _put(outs[0], root_inputs[0][dst_rank])
        return self._collective("scatter", (outputs, inputs), work, opts.rootRank)

    def gather(self, outputs, inputs, opts=None):
        def work(per_rank):
            root_outputs = per_rank[opts.rootRank][0]
            for src_rank, (_, ins) in enumerate(per_rank):
                _put(root_outputs[0][src_rank], ins[0])
        return self._collective("gather", (outputs, inputs), work, opts.rootRank)

    # -- point to point ---------------------------------------------------------------

    def send(self, tensors, dst: int, tag: int):
        box = self._world.mailboxes[(self.group_name, self.rank(), dst, tag)]
        box.append([t.detach().clone() for t in tensors])
        return _done_work()

    def recv(self, tensors, src: int, tag: int):
        box = self._world.mailboxes[(self.group_name, src, self.rank(), tag)]
        return _RecvWork(self, box, tensors, f"recv from rank {src} (tag {tag}) of group {self.group_name!r}")


def _for_this_rank(error: BaseException) -> BaseException:
    """Each rank raises an exception object of its own (they unwind on different threads)."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 (an exception type with another constructor)
        return RuntimeError(f"{type(error).__name__}: {error}")


def _which(key: tuple) -> str:
    return f"#{key[-1]}" if len(key) == 2 else "of a debugger command"


def _shapes(tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _show(signature) -> str:
    return "" if signature is None else f" {signature}"
