"""ReplicaLoader: each data-parallel replica's share of the same global batches, resumable in any layout.

The global batches are fixed by the dataset's length, the global batch size and the seed alone: epoch e is a
shuffle of the indices drawn from seed + e (or their order, shuffle=False), cut into batches of ``batch_size``
(the last incomplete one dropped). Replica r of R reads the r-th R-th of each. Its state is the number of global
samples consumed (counted as the loop takes each batch, not as workers prefetch them), so a run resumed with
another number of replicas reads, between them, the same global samples the saving run would have read next.
torchtitan's loader keeps each replica's own position instead, and cannot change the replica count (its issue 850).

With workers (num_workers > 0), DataLoader hands batch k of an epoch to worker k % num_workers, whose generators
have drawn for the batches it read before: a loader resumed mid-epoch would start its workers afresh and hand
batch k to another one. So a worker seeds torch's, Python's and numpy's generators before each batch from the
seed, the epoch, the batch and the replica alone: what the dataset draws in __getitem__ is the same in a resumed
run, whichever worker reads it and however many there are. Without workers the dataset draws from the rank's own
generators, which a checkpoint restores.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

__all__ = ["ReplicaLoader"]


class ReplicaLoader:
    """Iterate this replica's batches of ``dataset`` from where the run is, to the end of the epoch.

        data = ReplicaLoader(dataset, batch_size=32, replicas=engine.data_parallel, rank=engine.dp_rank)
        for x, y in data: ...        # batches of 32 / replicas rows; iterate again for the next epoch
        batches = data.forever()     # or: epoch after epoch, next(batches) a step
        engine.save(directory, optimizer, data=data)   # and engine.load(directory, optimizer, data=data)

    ``batch_size``: the global batch, all replicas together (it must divide by ``replicas``). Other keywords go to
    torch.utils.data.DataLoader (num_workers, collate_fn, pin_memory, ...), which does the loading.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        **loader: Any,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"ReplicaLoader needs a dataset with a length (a map-style Dataset), got {type(dataset)}")
        if batch_size < 1 or batch_size % replicas:
            raise ValueError(
                f"the global batch_size={batch_size} must be a positive multiple of replicas={replicas}: "
                "every replica reads an equal share of each batch"
            )
        if not 0 <= rank < replicas:
            raise ValueError(f"rank={rank} is not a replica of replicas={replicas} (0 to {replicas - 1})")
        self.batches_per_epoch = len(dataset) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"the dataset's {len(dataset)} samples make no batch of batch_size={batch_size}")
        self.dataset, self.batch_size, self.replicas, self.rank = dataset, batch_size, replicas, rank
        self.shuffle, self.seed, self.loader = shuffle, seed, loader
        self.consumed = 0  # global samples the training loop has taken, every epoch together

    @property
    def epoch(self) -> int:
        return self.consumed // (self.batches_per_epoch * self.batch_size)

    def __len__(self) -> int:
        """Batches left in this epoch."""
        return self.batches_per_epoch - self.consumed // self.batch_size % self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        sampler = _Shares(self, self.epoch, self.consumed // self.batch_size % self.batches_per_epoch)
        # DataLoader draws its workers' base seed from this generator: from torch's global one it would take a
        # draw each time it starts, and a resumed run's dropout would draw otherwise
        seeds = torch.Generator().manual_seed(self.seed + self.epoch)
        dataset = _Seeded(self.dataset) if self.loader.get("num_workers", 0) else self.dataset
        for batch in DataLoader(dataset, batch_sampler=sampler, **{"generator": seeds, **self.loader}):
            self.consumed += self.batch_size
            yield batch

    def forever(self) -> Iterator[Any]:
        """Batch after batch from where the run is, epoch after epoch (each shuffled anew)."""
        while True:
            yield from self

    def indices(self, epoch: int) -> list[int]:
        """The epoch's global order of samples (before it is cut into batches)."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def state_dict(self) -> dict[str, int]:
        return {
            "consumed": self.consumed,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "samples": len(self.dataset),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        differ = [
            f"{key} {state[key]} (now {mine[key]})"
            for key in ("batch_size", "samples", "shuffle")
            if state.get(key, mine[key]) != mine[key]
        ]
        if differ:
            raise ValueError(
                f"the saved position is in other batches: saved with {', '.join(differ)}; a resumed "
                "run reads the same global batches only with the same dataset and global batch_size"
            )
        self.consumed, self.seed = int(state["consumed"]), int(state["seed"])


class _Shares(Sampler[list[int]]):
    """One epoch's batches from ``start``: this replica's share of each."""

    def __init__(self, loader: ReplicaLoader, epoch: int, start: int) -> None:
        self.loader, self.epoch, self.start = loader, epoch, start

    def __len__(self) -> int:
        return self.loader.batches_per_epoch - self.start

    def __iter__(self) -> Iterator[list[int]]:
        order, size = self.loader.indices(self.epoch), self.loader.batch_size
        share = size // self.loader.replicas
        for b in range(self.start, self.loader.batches_per_epoch):
            mine = b * size + self.loader.rank * share
            yield _Batch(order[mine : mine + share], self._seed(b))

    def _seed(self, batch: int) -> int:
        """Batch ``batch`` of this epoch's seed, for this replica: from nothing a run's history changes."""
        seed = 0
        for part in (self.loader.seed, self.epoch, batch, self.loader.rank):
            seed = (seed * 1_000_003 + part) % 2**63
        return seed


class _Batch(list[int]):
    """A batch's indices, with the seed a worker draws its samples from (it travels to the worker with them)."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed


class _Seeded(Dataset[Any]):
    """The user's dataset, read by workers: the generators seeded from the batch before its samples are read."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        seed = getattr(indices, "seed", None)
        if seed is not None and get_worker_info() is not None:  # a worker's generators are its own to reseed
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                import numpy

                numpy.random.seed(seed % 2**32)
            except ImportError:
                pass
        own = getattr(self.dataset, "__getitems__", None)
        return list(own(list(indices))) if callable(own) else [self.dataset[i] for i in indices]
