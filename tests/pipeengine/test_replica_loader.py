"""ReplicaLoader without ranks: each replica's share of the same global batches, and a position that survives a
change of the replica count."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import TensorDataset

from pipeengine import ReplicaLoader

SAMPLES = TensorDataset(torch.arange(30))  # a sample is its own index


def global_batches(replicas: int, steps: int, state: dict[str, int] | None = None, **options: bool) -> list[list[int]]:
    """The global batches ``replicas`` loaders read together over ``steps`` steps (from ``state``)."""
    loaders = [ReplicaLoader(SAMPLES, 6, replicas=replicas, rank=r, seed=3, **options) for r in range(replicas)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    streams = [loader.forever() for loader in loaders]
    return [sorted(i for stream in streams for i in next(stream)[0].tolist()) for _ in range(steps)]


def test_every_replica_count_reads_the_same_global_batches_epoch_after_epoch() -> None:
    one = global_batches(1, 12)  # five batches an epoch: over two epochs and a bit
    assert global_batches(2, 12) == global_batches(3, 12) == global_batches(6, 12) == one
    first, second = one[:5], one[5:10]
    assert sorted(i for b in first for i in b) == sorted(i for b in second for i in b) == list(range(30))
    assert first != second  # each epoch shuffled anew
    assert global_batches(1, 5, shuffle=False) == [list(range(6 * b, 6 * b + 6)) for b in range(5)]


def test_the_position_counts_what_the_loop_took_and_resumes_with_other_replica_counts() -> None:
    whole = global_batches(1, 9)
    loaders = [ReplicaLoader(SAMPLES, 6, replicas=2, rank=r, seed=3, num_workers=2) for r in range(2)]
    streams = [loader.forever() for loader in loaders]
    for _ in range(7):  # workers prefetch ahead: the count is what the loop took
        for stream in streams:
            next(stream)
    state = loaders[0].state_dict()
    assert state["consumed"] == 7 * 6 and loaders[0].epoch == 1 and len(loaders[0]) == 3
    assert global_batches(3, 2, state) == global_batches(1, 2, state) == whole[7:9]


def test_what_cannot_resume_or_split_is_refused_with_the_values() -> None:
    with pytest.raises(ValueError, match=r"batch_size=6 must be a positive multiple of replicas=4"):
        ReplicaLoader(SAMPLES, 6, replicas=4)
    with pytest.raises(ValueError, match=r"rank=2 is not a replica of replicas=2"):
        ReplicaLoader(SAMPLES, 6, replicas=2, rank=2)
    saved = ReplicaLoader(SAMPLES, 6).state_dict()
    with pytest.raises(ValueError, match=r"saved with batch_size 6 \(now 10\).*same dataset and global batch_size"):
        ReplicaLoader(SAMPLES, 10).load_state_dict(saved)


def test_a_resumed_loader_reads_on_with_the_saved_seed() -> None:
    """A loader built with another seed and given the saved state reads what the saving loader would have next."""
    saving = ReplicaLoader(SAMPLES, 6, seed=3)
    stream = saving.forever()
    [next(stream) for _ in range(7)]  # into the second epoch: its order is drawn from the seed
    state = saving.state_dict()
    resumed = ReplicaLoader(SAMPLES, 6, seed=11)
    resumed.load_state_dict(state)
    again = resumed.forever()
    assert [next(again)[0].tolist() for _ in range(6)] == [next(stream)[0].tolist() for _ in range(6)]


class Noisy(torch.utils.data.Dataset[torch.Tensor]):
    """A sample draws from the generators of whoever reads it (torch's and Python's), as augmentations do."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item(), random.random()])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_loader_resumed_mid_epoch_with_workers_reads_the_same_samples(workers: int) -> None:
    uninterrupted = ReplicaLoader(Noisy(), 4, seed=2, num_workers=workers)
    expected = [batch.tolist() for batch in itertools.islice(uninterrupted.forever(), 9)]  # 1.5 epochs
    saving = ReplicaLoader(Noisy(), 4, seed=2, num_workers=workers)
    first = [batch.tolist() for batch in itertools.islice(saving.forever(), 4)]
    resumed = ReplicaLoader(Noisy(), 4, seed=2, num_workers=workers)
    resumed.load_state_dict(saving.state_dict())
    rest = [batch.tolist() for batch in itertools.islice(resumed.forever(), 5)]
    assert first + rest == expected
