"""The transport seam without processes: the loopback's messages and collectives, the config, the dispatch table."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pipeengine import EngineConfig, PeerError, PipelineError, launch
from pipeengine.comm.base import Transfer
from pipeengine.comm.loopback import Hub, LoopbackTransport
from pipeengine.step.executor import HANDLERS
from schedules import Kind, parse
from tests.pipeengine import ranks
from tests.pipeengine.parity import model_parity


def on_threads(size: int, body: Callable[[LoopbackTransport], Any], timeout: float = 5.0) -> list[Any]:
    """Run ``body`` on ``size`` loopback ranks of one hub; their results, or the first exception raised."""
    hub = Hub()
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = body(LoopbackTransport(hub, "world", tuple(range(size)), rank, timeout))
        except BaseException as error:  # noqa: BLE001  (handed back to the test)
            results[rank] = error
            hub.fail(rank, error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_messages_on_a_channel_are_received_in_the_order_sent() -> None:
    send, recv = parse("0SF0"), parse("1RF0")

    def body(t: LoopbackTransport) -> list[float]:
        if t.rank == 0:
            for value in (1.0, 2.0, 3.0):
                t.post([Transfer(True, (torch.full((2,), value),), 1, send)])
            return []
        transfers = [Transfer(False, (torch.empty(2),), 0, recv) for _ in range(3)]
        t.post(transfers)
        t.complete(transfers)
        return [float(tr.tensors[0][0]) for tr in transfers]

    assert on_threads(2, body)[1] == [1.0, 2.0, 3.0]


def test_a_message_of_another_shape_is_refused_not_truncated() -> None:
    def body(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.post([Transfer(True, (torch.ones(3),), 1, parse("0SF0"))])
        else:
            transfer = Transfer(False, (torch.empty(2),), 0, parse("1RF0"))
            t.post([transfer])
            t.wait(transfer)

    error = on_threads(2, body)[1]
    assert isinstance(error, ValueError) and "received (float32[3]) where its buffers are (float32[2])" in str(error)


def test_collectives_gather_broadcast_reduce_and_split() -> None:
    def body(t: LoopbackTransport) -> tuple[Any, ...]:
        gathered = t.all_gather(torch.tensor([t.rank]), "a test")
        value = torch.tensor([10.0 * t.rank])
        t.broadcast(value, 2, "a test")
        total, most = torch.tensor([t.rank + 1.0]), torch.tensor([float(t.rank)])
        t.all_reduce(total, "a test")
        t.all_reduce(most, "a test", op="max")
        later = torch.tensor([1.0])
        pending = t.start_all_reduce(later, "a test")
        objects = t.all_gather_object({"rank": t.rank}, "a test")
        pending.wait()
        half = t.split([[0, 1], [2, 3]])
        pair = half.all_gather(torch.tensor([t.rank]), "a test")
        return [int(g) for g in gathered], float(value), float(total), float(most), float(later), objects, pair

    for rank, result in enumerate(on_threads(4, body)):
        gathered, value, total, most, later, objects, pair = result
        assert gathered == [0, 1, 2, 3] and value == 20.0 and total == 10.0 and most == 3.0 and later == 4.0
        assert objects == [{"rank": r} for r in range(4)]
        assert [int(p) for p in pair] == ([0, 1] if rank < 2 else [2, 3])


def test_a_collective_that_times_out_names_the_ranks_that_did_not_arrive() -> None:
    def body(t: LoopbackTransport) -> None:
        if t.rank != 2:
            t.all_reduce(torch.ones(1), "the loss")
        else:
            time.sleep(2)  # past the others' timeout

    results = on_threads(3, body, timeout=0.5)
    assert isinstance(results[0], PeerError)
    assert "the loss failed after 0.5 s" in str(results[0]) and "ranks [2] of the group did not arrive" in str(
        results[0]
    )


def test_a_rank_that_fails_wakes_the_ranks_waiting_on_it_at_once() -> None:
    def body(t: LoopbackTransport) -> str:
        if t.rank == 1:
            raise KeyError("planted")
        with pytest.raises(PeerError) as caught:
            t.all_reduce(torch.ones(1), "the loss")
        return str(caught.value)

    # woken by the failure, not by its 600 s timeout (the test's own timeout would end first): the error is the
    # failure's, where a timeout would say "did not arrive ... within timeout" (no measured time is asserted)
    said = on_threads(2, body, timeout=600)[0]
    assert "rank 1 failed: KeyError" in said and "within timeout" not in said, said


def raise_on(rank: int) -> None:
    if ranks.rank() == rank:
        raise KeyError(f"raised on purpose by rank {rank}")
    ranks.barrier()


def test_in_process_launch_re_raises_the_cause_naming_its_rank() -> None:
    with pytest.raises(KeyError, match="raised on purpose by rank 1") as caught:
        launch(raise_on, 3, args=(1,), in_process=True, timeout=30)
    notes = "\n".join(caught.value.__notes__)
    assert "rank 1 of 3 is the cause" in notes and "rank 0: PeerError" in notes


@pytest.mark.parametrize(
    "options, error",
    [
        ({"num_microbatches": 0}, "num_microbatches must be a positive int, got 0"),
        ({"num_microbatches": 2, "schedule": "zigzag"}, "unknown schedule 'zigzag'; valid names: gpipe, 1f1b"),
        ({"num_microbatches": 2, "partition": "fastest"}, "valid: uniform, parameters, time, memory"),
        ({"num_microbatches": 2, "partition": [2, 0]}, "each stage's layer count in partition must be a positive"),
        ({"num_microbatches": 2, "timeout": 0}, "timeout must be a positive number of seconds"),
        ({"num_microbatches": 2, "checkpoint": "sometimes"}, "checkpoint must be one of never, always, except_last"),
        ({"num_microbatches": 2, "precision": "fp8"}, "precision must be one of None, fp32, bf16, fp16"),
        ({"num_microbatches": 2, "data_parallel": 1.5}, "data_parallel must be a positive int"),
    ],
)
def test_a_bad_option_is_refused_with_the_valid_ones(options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EngineConfig(**options)


def test_the_config_is_one_frozen_value() -> None:
    config = EngineConfig(num_microbatches=4, partition=[1, 2], device="cpu")  # type: ignore[arg-type]
    assert config.partition == (1, 2) and config.device == torch.device("cpu")
    with pytest.raises(AttributeError):
        config.num_microbatches = 8  # type: ignore[misc]


def one_zb_h1_step() -> None:
    model_parity("mlp", "zb-h1", [2], [4], 1)


def test_every_kind_has_a_handler_and_a_missing_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(HANDLERS) == set(Kind)
    monkeypatch.delitem(HANDLERS, Kind.BACKWARD_WEIGHT)  # as if a new kind had no handler yet
    with pytest.raises(PipelineError, match=r"instruction \d+ of training step 0: 0W0 .*: the executor has no handler"):
        launch(one_zb_h1_step, 2, in_process=True, timeout=30)
