"""Calibration: the prices the planner reads, measured on this machine and kept in a file (replaced whole or not at
all, refused naming what is wrong), each collective priced along the sizes it was measured at and by what it adds
to the compute before it, the frame of a step and the message latency timed as the runtime spends them."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine
from pipeengine.planner import calibration, probes, shared_cores, wakes
from pipeengine.tune import tune
from tests.pipeengine.models import mse
from tests.pipeengine.planning import PRICES, blocks, data
from tests.pipeengine.ranks import on_ranks


def test_a_collective_is_priced_along_the_sizes_it_was_measured_at(tmp_path: Path) -> None:
    """A Curve: between two measured sizes the line through them, below the smallest its time, past the largest the
    last slope; noise that makes a larger size cheaper is pooled to the mean of the sizes out of order; kept in the
    calibration file as its points."""
    curve = calibration.Curve.of([(4096, 2.0), (1024, 1.0), (16384, 1.5), (65536, 5.0)])  # 4096 and 16384 disagree
    assert curve.points == ((1024, 1.0), (4096, 1.75), (16384, 1.75), (65536, 5.0))
    assert (curve.time(0), curve.time(2560), curve.time(40960)) == (1.0, 1.375, 3.375)
    assert curve.time(65536 + 49152) == pytest.approx(5.0 + 3.25) and curve.latency == 1.0
    prices = dataclasses.replace(PRICES, collectives={"all_reduce": {2: curve}})
    assert prices.collective("all_reduce", 2, 2560) == 1.375
    assert prices.collective("all_reduce", 4, 1024) == pytest.approx(1.0 * 6 / 2)  # a ring's rounds, from 2 ranks
    kept = calibration.load(calibration.save(prices, tmp_path / "curve.json"))
    assert kept.collectives["all_reduce"][2] == curve


def test_a_calibration_file_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save writes a temporary file beside the kept one and renames it over (files.write_atomically): a write that
    fails half way (a full disk, a killed process) leaves the kept file as it was, readable, and no partial file."""
    kept = calibration.save(PRICES, tmp_path / "machine.json")
    before = kept.read_text()
    failed: list[str] = []

    def half_then_fail(self: Path, text: str, *args: object, **kwargs: object) -> int:
        with open(self, "w") as out:
            out.write(text[: len(text) // 2])
        failed.append(self.name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        calibration.save(dataclasses.replace(PRICES, overhead=1.0), kept)
    monkeypatch.undo()
    assert failed, "the failure was never injected: save no longer writes with Path.write_text"
    assert kept.read_text() == before and calibration.load(kept).overhead == PRICES.overhead
    assert [p.name for p in tmp_path.iterdir()] == ["machine.json"]  # the half-written temporary removed
    assert calibration.load(calibration.save(dataclasses.replace(PRICES, overhead=1.0), kept)).overhead == 1.0


FIXED = json.loads((Path(__file__).parents[1] / "calibration.json").read_text())
CURVE = [[1024, 1e-4], [4096, 2e-4]]
# (name, what the file holds instead, the field's path in the JSON and its value as the message shows them, the rule)
ODD = [
    ("a list", lambda r: [r], "it holds [{'host': ", "not a JSON object of prices"),
    (
        "measured twice",
        lambda r: {**r, "collectives": {"all_reduce": {"2": [[1024, 1e-4], [1024, 2e-4]]}}},
        'collectives["all_reduce"]["2"] is measured twice at 1024 bytes',
        "each size measured once",
    ),
    (
        "unsorted",
        lambda r: {**r, "crowded": {"all_gather": {"2": [[4096, 2e-4], [1024, 1e-4]]}}},
        'crowded["all_gather"]["2"] has 1024 bytes after 4096',
        "sizes ascend",
    ),
    (
        "zero bytes",
        lambda r: {**r, "collectives": {"all_reduce": {"2": [[0, 1e-4], [4096, 2e-4]]}}},
        'collectives["all_reduce"]["2"][0][0] is 0',
        "not a positive number of bytes",
    ),
    (
        "nan bytes",
        lambda r: {**r, "collectives": {"all_reduce": {"2": [[float("nan"), 1e-4]]}}},
        'collectives["all_reduce"]["2"][0][0] is nan',
        "not a positive number of bytes",
    ),
    (
        "inf seconds",
        lambda r: {**r, "collectives": {"all_reduce": {"2": [[1024, float("inf")]]}}},
        'collectives["all_reduce"]["2"][0][1] is inf',
        "not a number of seconds >= 0",
    ),
    (
        "negative seconds",
        lambda r: {**r, "collectives": {"all_gather": {"2": [[1024, 1e-4], [4096, -2e-4]]}}},
        'collectives["all_gather"]["2"][1][1] is -0.0002',
        "not a number of seconds >= 0",
    ),
    (
        "no points",
        lambda r: {**r, "collectives": {"all_reduce": {"2": []}}},
        'collectives["all_reduce"]["2"] is []',
        "not a [latency, seconds per byte] pair or a list of",
    ),
    (
        "one rank",
        lambda r: {**r, "collectives": {"all_reduce": {"1": CURVE}}},
        "collectives[\"all_reduce\"] has the group size '1'",
        "2 or more ranks",
    ),
    (
        "frame of one",
        lambda r: {**r, "frame": {"pipeline": {"1": 1e-3}}},
        "frame[\"pipeline\"] has the group size '1'",
        "2 or more ranks",
    ),
    (
        "named group",
        lambda r: {**r, "frame": {"replicas": {"two": 1e-3}}},
        "frame[\"replicas\"] has the group size 'two'",
        "a whole number",
    ),
    (
        "padded group",
        lambda r: {**r, "fsdp": {**r["fsdp"], "gather": {"02": 1e-3}}},
        "fsdp[\"gather\"] has the group size '02'",
        'written as "2"',
    ),
    (
        "unknown op",
        lambda r: {**r, "collectives": {"broadcast": {"2": CURVE}}},
        "collectives has 'broadcast'",
        "all_reduce, all_gather, reduce_scatter",
    ),
    ("world of 0", lambda r: {**r, "world_size": 0}, "world_size is 0", "a whole number of ranks, 2 or more"),
    ("processors as text", lambda r: {**r, "processors": "2"}, "processors is '2'", "not a positive number of ranks"),
    ("processors as true", lambda r: {**r, "processors": True}, "processors is True", "not a positive number"),
    ("huge", lambda r: {**r, "copy": 10**400}, "copy is 1000", "not a number of seconds >= 0"),
    (
        "one hook",
        lambda r: {**r, "fsdp": {**r["fsdp"], "hooks": [1e-4]}},
        'fsdp["hooks"] is [0.0001]',
        "not a [forward seconds, backward seconds] pair",
    ),
    ("no overhead", lambda r: {k: v for k, v in r.items() if k != "overhead"}, "overhead is missing", "seconds"),
    ("no host", lambda r: {k: v for k, v in r.items() if k != "host"}, "host is missing", "the machine"),
    ("later format", lambda r: {**r, "format": 3}, "it is of format 3, written by a later pipeengine", "reads 2"),
]


@pytest.mark.parametrize(("holds", "said", "rule"), [odd[1:] for odd in ODD], ids=[odd[0] for odd in ODD])
def test_an_odd_calibration_file_is_refused_naming_the_field_its_value_and_the_rule(
    tmp_path: Path, holds: object, said: str, rule: str
) -> None:
    """Well-formed JSON the planner cannot price with (a curve measured twice at one size divided by zero, a
    collective or frame over one rank, a number as text) is refused as it is read, not as a ZeroDivisionError when a
    layout is priced: the file, the field's path in the JSON, its value, the rule, and what to do."""
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(holds(FIXED)))  # type: ignore[operator]
    with pytest.raises(
        ValueError,
        match=rf"calibration file {re.escape(str(path))} is refused: {re.escape(said)}"
        rf".*{re.escape(rule)}.*; delete it or run python -m pipeengine\.tune "
        r"--calibrate --world-size N .* again",
    ):
        calibration.load(path)


def test_a_calibration_file_with_a_key_written_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    text = json.dumps(FIXED)
    path.write_text(text.replace('"overhead": ', '"overhead": 1.0, "overhead": ', 1))
    with pytest.raises(ValueError, match=r"cannot be read \(ValueError: the key 'overhead' is written twice"):
        calibration.load(path)


def test_processors_are_measured_per_machine_and_the_most_crowded_one_counts() -> None:
    """calibration's processors from each rank's (host, seconds alone, (start, end) of each run all at once)."""
    one = [("a", 1.0, [(0.0, 2.0), (0.0, 2.0)])] * 4  # 4 ranks, each 1 s alone, all done 2 s after the first began
    assert shared_cores.sharing(one) == pytest.approx(2.0)
    # two machines whose clocks differ by an hour, each its own span: b's 4 ranks slow each other 4x -> 8 / 4
    two = [("a", 1.0, [(0.0, 2.0)])] * 4 + [("b", 1.0, [(3600.0, 3604.0)])] * 4
    assert shared_cores.sharing(two) == pytest.approx(2.0)
    assert shared_cores.sharing([("a", 1.0, [(0.0, 1.05)])] * 2) is None  # a core each


def test_a_frame_is_the_trimmed_mean_of_its_samples() -> None:
    """Two-valued samples (0.4 or 2.5 ms, about as often) give the mean of both, not one of them as a median would;
    a stall (50 ms) is cut."""
    samples = [0.4] * 10 + [2.5] * 10 + [50.0]
    assert probes.trimmed(samples) == pytest.approx((8 * 0.4 + 9 * 2.5) / 17)
    assert probes.trimmed([0.4] * 11 + [2.5] * 9) < probes.trimmed([0.4] * 9 + [2.5] * 11)  # moves with how often
    assert probes.trimmed([3.0]) == 3.0


class _Clock:
    """probes' own clock in a rank, moved only by what a test runs: a fit is checked exactly, whatever the load."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@on_ranks(2)
def test_a_collective_is_priced_by_what_it_adds_to_the_compute_before_it() -> None:
    """calibration times each collective after a compute, as a step runs it, and prices what it adds: with a 20 ms
    compute before each 3 ms all-reduce, the price is the all-reduce's, not the 20 ms beside it."""
    import types

    clock = probes.time = _Clock()  # type: ignore[assignment]  # this rank's module only
    real = probes.dist

    def all_reduce(*args: object, **kwargs: object) -> None:
        real.all_reduce(*args, **kwargs)
        clock.sleep(0.003)

    probes.dist = types.SimpleNamespace(**{name: getattr(real, name) for name in dir(real) if not name.startswith("_")})
    probes.dist.all_reduce = all_reduce
    probes.busy = lambda device: lambda: clock.sleep(0.02)  # type: ignore[assignment]
    price = probes.collective("all_reduce", 256, None, 2, 3, torch.device("cpu"), rounds=2)
    assert price == pytest.approx(0.003, rel=1e-9), price


@on_ranks(2)
def test_the_message_latency_is_the_chain_of_stages_less_the_frame_timed_beside_it() -> None:
    """probes.host: the host cost per compute from a pipeline of one rank; the latency from a chain of stages less
    the world's pipeline frame, timed in turn with it (here an 8 ms chain, a 5 ms frame, a program of 6 messages:
    0.5 ms each), and that frame."""
    clock = probes.time = _Clock()  # type: ignore[assignment]  # this rank's module only

    class Engine:
        def __init__(self, model: nn.Sequential, *args: object, **kwargs: object) -> None:
            self.schedule, self.seconds = ("single", 0.001) if len(model) == 1 else ("chain", 0.008)

        def train_step(self, *args: object) -> None:
            clock.sleep(self.seconds)

    probes.pipeline_frame = lambda group, size, device: lambda: clock.sleep(0.005)  # type: ignore[assignment]

    def price(program: str, overhead: float, latency: float) -> float:
        return 10 * overhead if program == "single" else 6 * latency

    overhead, latency, frame = probes.host(Engine, price, 10, torch.device("cpu"))
    assert overhead == pytest.approx(1e-4, rel=1e-6) and latency == pytest.approx(5e-4, rel=1e-6), (overhead, latency)
    assert frame == pytest.approx(0.005, rel=1e-9)


def test_calibration_keeps_its_file_and_the_planner_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = tmp_path / "machine.json"
    path, prices = calibration.measure_machine(2, PipelineEngine, "gloo", kept)
    record = json.loads(path.read_text())
    assert path == kept and record["world_size"] == 2 and record["backend"] == "gloo" and record["date"][:2] == "20"
    assert prices.calibrated and prices.source.startswith(f"calibrated on {record['host']} at {record['date']}")
    assert prices.overhead > 0 and prices.p2p.latency > 0 and set(prices.collectives) == set(calibration.COLLECTIVES)
    assert all(set(groups) == {2} for groups in prices.collectives.values())
    # two ranks on this machine's cores: each at full speed (None), or slowing each other (fewer than 2 processors)
    assert prices.processors is None or 0.5 < prices.processors < 2
    assert record["processors"] == prices.processors
    # ranks sharing processors: how late a woken rank starts behind the others' work, one point per burst (wakes)
    shared_ranks = prices.processors is not None and prices.processors < 2
    assert len(prices.wake) == (len(wakes.BURSTS) if shared_ranks else 0)
    assert record["wake"] == [list(point) for point in prices.wake]
    assert all(compute > 0 and late >= 0 for compute, late in prices.wake)
    # a step's frame over a pipeline and over replicas of the 2 ranks, posting and copying: measured, kept, read
    assert set(prices.frame) == {"pipeline", "replicas"} and all(set(g) == {2} for g in prices.frame.values())
    assert min(prices.frame["pipeline"][2], prices.frame["replicas"][2], prices.post, prices.copy) > 0
    assert prices.post_message >= 0 and record["post"] == [prices.post, prices.post_message]
    assert len(prices.fsdp["hooks"]) == 2 and set(prices.fsdp["gather"]) == set(prices.fsdp["reduce"]) == {2}
    shared = calibration.save(dataclasses.replace(prices, processors=1.25), tmp_path / "shared.json")
    assert calibration.load(shared).processors == 1.25
    x, y = data()
    result = tune(
        blocks(2),
        mse,
        x,
        2,
        target=y,
        prices=kept,
        schedules=["1f1b"],
        microbatches=[2],
        checkpoint=["never"],
        repeats=1,
        allocator=False,
    )
    assert result.prices == prices.source and str(kept) in str(result)
    monkeypatch.setenv("PIPEENGINE_CALIBRATION", str(tmp_path / "none.json"))  # none kept: the built-in constants
    assert not calibration.load().calibrated and calibration.load().source.startswith("built-in constants")
    with pytest.raises(FileNotFoundError, match="run python -m pipeengine.tune --calibrate --world-size N"):
        calibration.load(tmp_path / "none.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json cannot be read"):
        calibration.load(tmp_path / "broken.json")
