"""A hardware description measured where it runs (issue 59, item 1: --calibrate on the user's GPUs): the ring fit
against injected times; the measuring on 2 gloo ranks laid out as two nodes or as one, which figures it measures
and which it keeps from the preset, saying so; the command line on one CPU process, and its refusal without a GPU.
What a GPU measures is checked where one is lent (tests/pipeengine/test_cuda.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipeengine.planner.cli import main
from pipeengine.planner.cluster import Hardware, all_reduce, load
from pipeengine.planner.cluster.calibrate import fit_ring, measure
from tests.pipeengine.ranks import all_gather_object, on_ranks, rank


def test_the_ring_fit_recovers_the_links_figures_from_times_priced_with_them() -> None:
    """Times made by collectives.all_reduce at a known link give that link back (the fit is the pricing inverted)."""
    from pipeengine.planner.cluster import Link

    link = Link(bandwidth=180e9, latency=7e-6)
    sizes = [2**20, 2**23, 2**26, 2**28]
    for group in (2, 8, 16):
        bandwidth, latency = fit_ring(sizes, [all_reduce(size, group, link) for size in sizes], group)
        assert bandwidth == pytest.approx(180e9, rel=1e-9) and latency == pytest.approx(7e-6, rel=1e-6)


@pytest.mark.parametrize(
    ("sizes", "seconds", "ranks", "said"),
    [
        ([2**20, 2**20], [1e-3, 2e-3], 2, "give two distinct sizes or more"),
        ([2**20, 2**22], [1e-3], 2, "a time each"),
        ([2**20, 2**22], [1e-3, 1e-3], 2, "do not grow with the sizes"),
        ([2**20, 2**22], [1e-3, 2e-3], 1, "over 2 ranks or more"),
    ],
)
def test_the_ring_fit_refuses_what_is_not_a_measurement_of_a_link(
    sizes: list[int], seconds: list[float], ranks: int, said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        fit_ring(sizes, seconds, ranks)


@on_ranks(2)
def test_two_ranks_measure_the_link_between_them_and_keep_the_presets_other() -> None:
    """One rank a node: the link across nodes is measured, the one within is the preset's; two a node: the
    reverse. Matmul efficiency and memory bandwidth are measured either way, each source naming the measurement;
    every rank holds the one description, rank 0's host and moment in its sources (here rank 1's clock is a minute
    on and its host named otherwise)."""
    import datetime
    import types

    from pipeengine.planner.cluster import calibrate

    if rank() == 1:  # this rank's own module: the other rank's is left as it is
        later = datetime.datetime.now() + datetime.timedelta(minutes=1)
        calibrate.datetime = types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: later))  # type: ignore[assignment]
        calibrate.socket = types.SimpleNamespace(gethostname=lambda: "elsewhere")  # type: ignore[assignment]
    # the module's own clock, moved 1 us a reading and, by each all-reduce it times, 10 us + its bytes at 1 GB/s: the
    # fit is checked exactly, whatever the load (real gloo timings of 4 KiB and 4 MiB crossed under a full suite)
    clock = types.SimpleNamespace(now=0.0)

    def perf_counter() -> float:
        clock.now += 1e-6
        return clock.now

    real = calibrate.dist

    def all_reduce(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        done = real.all_reduce(tensor, *args, **kwargs)
        if tensor.dtype == torch.float32:  # the buffers ring() times, not the float64 maximum of a timing
            clock.now += 1e-5 + tensor.numel() * 4 / 1e9
        return done

    calibrate.time = types.SimpleNamespace(perf_counter=perf_counter)  # type: ignore[assignment]
    public = {name: getattr(real, name) for name in dir(real) if not name.startswith("_")}
    calibrate.dist = types.SimpleNamespace(**public)  # type: ignore[assignment]
    calibrate.dist.all_reduce = all_reduce
    base = load("a100-80gb")
    for per_node in (1, 2):
        found = measure(
            base,
            dtype="fp32",
            shapes=[(32, 64, 16)],
            sizes=(2**12, 2**22),
            copy_bytes=2**20,
            repeats=3,
            device=torch.device("cpu"),
            per_node=per_node,
            squares=(64,),
        )
        assert Hardware.from_json(found.to_json(), "measured") == found  # held to a file's rules
        assert found.peak_flops == base.peak_flops and found.memory_bytes == base.memory_bytes  # the datasheet's
        assert all_gather_object(found.to_json()) == [found.to_json()] * 2
        measured, kept = ("inter", "intra") if per_node == 1 else ("intra", "inter")
        for figure in ("matmul_efficiency", "memory_bandwidth", f"{measured}.bandwidth"):
            assert found.sources[figure].startswith("measured on "), found.sources[figure]
        assert "all_reduce over " in found.sources[f"{measured}.bandwidth"]
        assert getattr(found, kept) == getattr(base, kept)
        why = "one node" if kept == "inter" else "one rank a node"
        assert found.sources[f"{kept}.bandwidth"].startswith(f"the preset's, not measured ({why})")
        assert getattr(found, measured).bandwidth == pytest.approx(1e9)  # busbw of 2 ranks: the bytes' rate
        # the sweep as measured: each size over its time (the all-reduce's 10 us and bytes, the clock's 1 us a read)
        sweep = [figure for point in getattr(found, measured).sweep for figure in point]
        assert sweep == pytest.approx([f for s in (2**12, 2**22) for f in (s, s / (1.1e-5 + s / 1e9))]), sweep
        assert found.sources[f"{measured}.sweep"].startswith("measured on ")
        assert getattr(found, kept).sweep == getattr(base, kept).sweep  # the preset's, kept with its source
        assert "32x64x16" in found.sources["matmul_efficiency"]  # the model's shape, beside the squares


def test_the_command_line_writes_a_description_the_planner_reads(tmp_path: Path) -> None:
    out = tmp_path / "mine.json"
    code = main(
        [
            "--calibrate",
            "--hardware",
            "h100-sxm",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--repeats",
            "2",
            "--precision",
            "fp32",
            "--shapes",
            "16x32x8",
        ]
    )
    assert code == 0
    found = load(out)
    assert found.name == f"{load('h100-sxm').name}, measured"
    assert found.sources["matmul_efficiency"].startswith("measured on ")
    assert found.sources["intra.latency"].startswith("the preset's, not measured (one rank a node)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], r"measures GPUs and this machine has none .* --device cpu tries it here"),
        (["--device", "cpu", "--shapes", "16x32"], r"--shapes: '16x32' is not m x k x n"),
        (["--device", "cpu", "--hardware", "b300"], r"'b300' is neither a preset nor a hardware description file"),
    ],
)
def test_the_command_line_refuses_saying_why(
    extra: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--calibrate", "--hardware", "h100-sxm", "--out", str(tmp_path / "x.json"), *extra])
    assert code == 2
    assert re.search(said, capsys.readouterr().err)
    assert not (tmp_path / "x.json").exists()
