"""The optional CPU host model (pipeengine.planner.shared_cores): nothing where ranks have processors of their own,
and how ranks that share a machine's cores split a collective into work and wait, by hand."""

from __future__ import annotations

import pytest

from pipeengine.planner import shared_cores


def test_ranks_with_processors_of_their_own_wait_through_every_collective_at_full_speed() -> None:
    assert shared_cores.split(2e-3, 5e-3, None, tensor_parallel=2, world=8) == (0.0, 2e-3)
    assert shared_cores.replicas_speed(None, world=8) == 1.0
    assert shared_cores.per_pipeline(None, data_parallel=2, tensor_parallel=2) is None
    assert shared_cores.wake(None, repeats=3) == ()  # nothing measured, no process group needed


def test_shared_cores_split_a_collective_by_how_much_crowding_slowed_it() -> None:
    """2 processors, tp 2 of a world of 4: pure work runs 2x slower with every group at once (1 / (2 / 4)). A
    collective crowding slowed 1.5x is half work (at full speed: tp <= processors) and half wait; one it slowed 2x
    or more is all work; one it did not slow, all wait."""
    work, wait = shared_cores.split(2e-3, 3e-3, 2.0, tensor_parallel=2, world=4)
    assert (work, wait) == (pytest.approx(1e-3), pytest.approx(1e-3))
    assert shared_cores.split(2e-3, 5e-3, 2.0, tensor_parallel=2, world=4) == (pytest.approx(2e-3), 0.0)
    assert shared_cores.split(2e-3, 2e-3, 2.0, tensor_parallel=2, world=4) == (0.0, pytest.approx(2e-3))
    # 1 processor for a group of 2: the work share is brought down to the group's speed on it
    assert shared_cores.split(2e-3, 5e-3, 1.0, tensor_parallel=2, world=4)[0] == pytest.approx(2e-3 * 0.5)
    assert shared_cores.replicas_speed(2.0, world=4) == 0.5 and shared_cores.per_pipeline(4.0, 2, 2) == 1.0
