"""DataLoader: global batches of a map-style dataset, each DP rank reading its slice.

The loader knows the device mesh: the size of its data-parallel dim (``dp_dim``, "DP" by
default) is the DP degree, and this rank's coordinate on that dim says which part of each
global batch it reads. Ranks that differ only in their other coordinates (TP, PP, ...)
read identical batches.

The order depends on nothing but the seed, the epoch and the dataset's length: epoch e's
permutation is ``torch.randperm(len(dataset))`` drawn from a generator seeded from
(seed, e) (``range(len(dataset))`` when ``shuffle=False``), global batch t of the epoch
is ``perm[t*G : (t+1)*G]`` (G = ``global_batch_size``), and DP rank r reads the r-th
contiguous part of it (``torch.tensor_split(batch, dp)[r]``). The global batches are
therefore the same on any mesh and world size, and the position in an epoch is one
number, the count of samples handed out so far, which is what ``state_dict()`` saves:
a loader resumed on another DP degree, or with another global batch size, goes on with
exactly the samples of the epoch not yet seen.

Batches are plain tensors, collated by ``collate_fn`` (default:
``torch.utils.data.default_collate``); a model's parallel plan turns them into DTensors.
Samples are read in this process (there are no worker processes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset, default_collate

__all__ = ["DataLoader"]

_STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "global_batch_size")
_M64 = 2**64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _M64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of an epoch's permutation: a mix of both numbers, so that
    (seed, epoch) pairs do not collide as ``seed + epoch`` would ((0, 1) and (1, 0))."""
    return _splitmix64(_splitmix64(seed % _M64) ^ (epoch % _M64)) % 2**63


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class DataLoader:
    """Iterates over global batches of ``dataset``; each DP rank gets its slice.

    ``DataLoader(dataset, mesh, *, global_batch_size, dp_dim="DP", shuffle=True, seed=0,
    drop_last=True, collate_fn=None)``

    - ``dataset``: map-style (``__len__`` and ``__getitem__(int)``; ``__getitems__(list)``
      is used when it has one), e.g. ``torch.utils.data.TensorDataset`` or a list.
    - ``mesh``: the vescale DeviceMesh the model runs on (the whole mesh, or its DP
      sub-mesh). Its dim named ``dp_dim`` is the data-parallel dim; a mesh without such a
      dim, ``dp_dim=None`` or ``mesh=None`` (one process) give DP degree 1.
    - ``global_batch_size``: samples per step over all DP ranks; it must divide by the DP
      degree, and each rank gets ``global_batch_size // dp`` of them.
    - ``drop_last=False`` keeps the epoch's last, smaller global batch: it is split over
      the DP ranks as evenly as possible (``torch.tensor_split``: the first ranks get one
      more), so a rank may get fewer samples than the others, or none (then its batch is
      the collated structure with 0 rows: with the default collate, every tensor of one
      collated sample cut to ``[:0]``; a custom ``collate_fn`` is called with ``[]``).

    ``len(loader)`` is the number of global batches in an epoch. Iterating yields the
    batches of the current epoch from the current position, then moves to the next epoch,
    so ``for epoch in range(n): for batch in loader: ...`` reads n epochs. ``epoch``,
    ``set_epoch(e)`` (as ``DistributedSampler.set_epoch``), ``state_dict()`` and
    ``load_state_dict()`` (also through ``vescale.save`` / ``vescale.load``) make it
    resumable on any mesh.
    """

    def __init__(self, dataset, mesh=None, *, global_batch_size: int, dp_dim: str | None = "DP",
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 collate_fn: Callable[[list], Any] | None = None):
        _check_dataset(dataset)
        if not _is_int(global_batch_size) or global_batch_size < 1:
            raise ValueError(f"global_batch_size must be a positive int (samples per step over all DP ranks), "
                             f"got {global_batch_size!r}")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        if not _is_int(seed):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be a callable that takes a list of samples (or None for "
                            f"torch.utils.data.default_collate), got {collate_fn!r}")
        self.dataset = dataset
        self.mesh = mesh
        self.dp_dim = dp_dim
        self.dp_size, self.dp_rank = _dp_of(mesh, dp_dim)
        if global_batch_size % self.dp_size:
            raise ValueError(f"global_batch_size {global_batch_size} does not divide by the DP degree "
                             f"{self.dp_size} (mesh dim {dp_dim!r}): pass a multiple of {self.dp_size}, "
                             f"e.g. {global_batch_size - global_batch_size % self.dp_size or self.dp_size}")
        self._global_batch_size = global_batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._consumed = 0
        self._perm: tuple[tuple, torch.Tensor] | None = None  # (key, permutation) of the last epoch used
        self._check_not_empty()

    # ---- sizes ----
    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this rank (the last batch may have fewer with drop_last=False)."""
        return self._global_batch_size // self.dp_size

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    def __len__(self) -> int:
        """Global batches per epoch (the same number on every rank)."""
        n, g = len(self.dataset), self._global_batch_size
        return n // g if self.drop_last else -(-n // g)

    # ---- position ----
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch handed out so far, over all DP ranks."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Makes ``epoch`` the current epoch, read from its start. Setting the epoch the
        loader is already in keeps its position, so that a resumed loop that calls
        ``set_epoch(epoch)`` at the top of each epoch (the DistributedSampler habit) does
        not read the part of the epoch it saw before the checkpoint again."""
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"set_epoch needs an epoch number >= 0, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch, self._consumed = epoch, 0

    def _remaining_batches(self) -> int:
        left, g = len(self.dataset) - self._consumed, self._global_batch_size
        return max(left, 0) // g if self.drop_last else -(-max(left, 0) // g)

    def _check_not_empty(self) -> None:
        if len(self) == 0:
            raise ValueError(f"the dataset's {len(self.dataset)} samples make no global batch of "
                             f"{self._global_batch_size} with drop_last=True: pass a smaller global_batch_size "
                             f"or drop_last=False")

    # ---- iteration ----
    def __iter__(self) -> Iterator[Any]:
        self._check_not_empty()
        if self._consumed > 0 and self._remaining_batches() == 0:
            self._epoch, self._consumed = self._epoch + 1, 0  # a loop left after the epoch's last batch
        while self._remaining_batches() > 0:
            start = self._consumed
            ids = self._permutation()[start:start + self._global_batch_size]
            batch = self._load(torch.tensor_split(ids, self.dp_size)[self.dp_rank].tolist(), int(ids[0]))
            self._consumed = start + len(ids)
            yield batch
        self._epoch, self._consumed = self._epoch + 1, 0

    def global_batch_indices(self, epoch: int | None = None) -> list[list[int]]:
        """The sample indices of every global batch of ``epoch`` (default: the current
        one), from its start: what all DP ranks together read, the same on every rank."""
        epoch = self._epoch if epoch is None else epoch
        perm, g = self._permutation(epoch), self._global_batch_size
        return [perm[t * g:(t + 1) * g].tolist() for t in range(len(self))]

    def _permutation(self, epoch: int | None = None) -> torch.Tensor:
        epoch = self._epoch if epoch is None else epoch
        n = len(self.dataset)
        key = (n, self._shuffle, self._seed, epoch)
        if self._perm is None or self._perm[0] != key:
            if self._shuffle:
                g = torch.Generator().manual_seed(epoch_seed(self._seed, epoch))
                perm = torch.randperm(n, generator=g)
            else:
                perm = torch.arange(n)
            self._perm = (key, perm)
        return self._perm[1]

    def _load(self, indices: list[int], first: int):
        collate = self.collate_fn or default_collate
        if not indices:
            if self.collate_fn is not None:
                return self.collate_fn([])
            return _empty_like(default_collate(self._fetch([first])))
        return collate(self._fetch(indices))

    def _fetch(self, indices: list[int]) -> list:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices))
        return [self.dataset[i] for i in indices]

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """The position, as plain values that are the same on every rank:
        {"epoch", "consumed" (samples of the epoch handed out, over all DP ranks), "seed",
        "shuffle", "global_batch_size"}."""
        return {"epoch": self._epoch, "consumed": self._consumed, "seed": self._seed,
                "shuffle": self._shuffle, "global_batch_size": self._global_batch_size}

    def check_state_dict(self, state: Any) -> str | None:
        """None when ``load_state_dict(state)`` would succeed, else the problem (vescale.load
        asks this of every rank before it changes anything)."""
        if not isinstance(state, Mapping):
            return f"a DataLoader state must be a dict with keys {list(_STATE_KEYS)}, got {type(state).__name__}"
        missing = [k for k in _STATE_KEYS if k not in state]
        extra = [k for k in state if k not in _STATE_KEYS]
        if missing or extra:
            return (f"DataLoader state has keys {sorted(state)}; it needs exactly {list(_STATE_KEYS)}"
                    + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else ""))
        for k in ("epoch", "consumed", "global_batch_size", "seed"):
            if not _is_int(state[k]):
                return f"DataLoader state {k!r} must be an int, got {state[k]!r}"
        if not isinstance(state["shuffle"], bool):
            return f"DataLoader state 'shuffle' must be True or False, got {state['shuffle']!r}"
        if state["epoch"] < 0 or state["global_batch_size"] < 1:
            return f"DataLoader state has epoch {state['epoch']} and global_batch_size {state['global_batch_size']}"
        n = len(self.dataset)
        if not 0 <= state["consumed"] <= n:
            return (f"DataLoader state says {state['consumed']} samples of epoch {state['epoch']} were consumed, "
                    f"but this dataset has {n}: it was saved with another dataset; load it with the same "
                    f"dataset, or call set_epoch(e) to start an epoch afresh instead of loading the state")
        return None

    def load_state_dict(self, state: Mapping) -> None:
        """Continues where the saved loader stopped: same epoch, the samples of it not yet
        handed out, in the same order. The saved ``seed`` and ``shuffle`` replace this
        loader's (they define the epoch's order); this loader's global batch size and DP
        degree may differ from the saved ones: the rest of the epoch is cut into batches
        of this loader's size."""
        problem = self.check_state_dict(state)
        if problem is not None:
            raise ValueError(problem)
        self._epoch, self._consumed = state["epoch"], state["consumed"]
        self._seed, self._shuffle = state["seed"], state["shuffle"]

    def __repr__(self) -> str:
        return (f"DataLoader({len(self.dataset)} samples, global_batch_size={self._global_batch_size}, "
                f"dp={self.dp_size}" + (f" (index {self.dp_rank} on {self.dp_dim!r})" if self.dp_size > 1 else "")
                + f", shuffle={self._shuffle}, "
                f"seed={self._seed}, drop_last={self.drop_last}, epoch={self._epoch}, consumed={self._consumed})")


def _check_dataset(dataset) -> None:
    what = f"{type(dataset).__name__}"
    if isinstance(dataset, IterableDataset):
        raise TypeError(f"vescale.DataLoader needs a map-style dataset (with __len__ and __getitem__), got the "
                        f"IterableDataset {what}: global batches and resumable positions need indexable samples. "
                        f"Pass a map-style dataset (e.g. torch.utils.data.TensorDataset, or a list of samples), "
                        f"or shard the stream yourself with torch.utils.data.DataLoader")
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        lacks = [m for m in ("__len__", "__getitem__") if not hasattr(dataset, m)]
        raise TypeError(f"vescale.DataLoader needs a map-style dataset (with __len__ and __getitem__); {what} has "
                        f"no {' or '.join(lacks)}. Pass a map-style dataset (e.g. torch.utils.data.TensorDataset, "
                        f"or a list of samples)")
    try:
        len(dataset)
    except TypeError as e:
        raise TypeError(f"vescale.DataLoader needs a map-style dataset with a length; len() of {what} failed "
                        f"({e}). Pass a dataset whose __len__ returns its number of samples") from e


def _dp_of(mesh, dp_dim: str | None) -> tuple[int, int]:
    """(DP degree, this rank's DP index) on ``mesh``."""
    if mesh is None or dp_dim is None:
        return 1, 0
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if dp_dim not in names:
        close = [n for n in names if n.lower() == str(dp_dim).lower()]
        if close:
            raise ValueError(f"the mesh has no dim {dp_dim!r} but has {close[0]!r} (names are case-sensitive): "
                             f"pass dp_dim={close[0]!r}")
        return 1, 0
    coord = mesh.get_coordinate()
    if coord is None:
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"rank {rank} is not part of the mesh {mesh}: build the DataLoader only on the mesh's ranks")
    d = names.index(dp_dim)
    return int(mesh.shape[d]), int(coord[d])


def _empty_like(batch):
    """The collated structure with no rows: tensors cut to [:0], lists of values emptied."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        if all(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            return type(batch)(_empty_like(v) for v in batch)
        return type(batch)()  # a batch of non-tensor values (strings, ...)
    return batch
