"""The cluster planner's machine is data (issue 59, step 1): each preset loads, cites every figure and reads back
equal; a malformed description is refused naming the file and the field; a collective costs what nccl-tests' bus
bandwidth and NCCL's step counts say, by hand, on injected links; a group's link is the node's where every such
group fits in one node, else the NICs of its members per node. No processes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeengine.planner.cluster import (
    PRESETS,
    Hardware,
    Link,
    all_gather,
    all_reduce,
    group_link,
    load,
    reduce_scatter,
    send_recv,
)
from pipeengine.planner.cluster.hardware import FIGURES, parse

FAST = Link(bandwidth=100e9, latency=5e-6)  # injected: 100 GB/s busbw, 5 us a step
SLOW = Link(bandwidth=25e9, latency=20e-6)


def machine(devices_per_node: int = 8) -> Hardware:
    described = load("a100-80gb").to_json()
    described.update(devices_per_node=devices_per_node, intra=FAST.to_json(), inter=SLOW.to_json())
    return Hardware.from_json(described, "test")


@pytest.mark.parametrize("name", ["a100-80gb", "h100-sxm", "h200"])
def test_preset_loads_cites_every_figure_and_reads_back_equal(name: str, tmp_path: Path) -> None:
    hardware = load(name)
    assert name in PRESETS
    swept = {f"{tier}.sweep" for tier in ("intra", "inter") if getattr(hardware, tier).sweep}
    assert set(hardware.sources) == set(FIGURES) | swept and all(text.strip() for text in hardware.sources.values())
    assert Hardware.from_json(hardware.to_json(), "again") == hardware
    written = tmp_path / f"{name}.json"
    written.write_text(json.dumps(hardware.to_json()))
    assert load(written) == load(str(written)) == hardware
    assert hardware.devices_per_node == 8 and hardware.peak_flops["bf16"] == hardware.peak_flops["fp16"]
    assert hardware.intra.bandwidth > hardware.inter.bandwidth and hardware.intra.latency < hardware.inter.latency
    assert 0.5 < hardware.matmul_efficiency < 1


def test_preset_figures_as_cited() -> None:
    a100, h100, h200 = (load(name) for name in ("a100-80gb", "h100-sxm", "h200"))
    assert a100.peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert a100.matmul_efficiency == pytest.approx(271.2 / 312, abs=5e-4)  # Bekman's MAMF table
    assert h100.matmul_efficiency == pytest.approx(794.5 / 989, abs=5e-4)
    assert h200.matmul_efficiency == pytest.approx(801.0 / 989.4, abs=1e-3)  # measured on the lent H200
    assert (a100.inter.bandwidth, h100.inter.bandwidth) == (200e9 / 8, 400e9 / 8)  # one HDR / NDR NIC a GPU
    assert (a100.memory_bytes, h100.memory_bytes, h200.memory_bytes) == (80e9, 80e9, 141e9)
    assert a100.memory_bandwidth == 1.80e12  # measured, 88% of the datasheet's 2.039e12 (the forum thread cited)
    assert (h100.memory_bandwidth, h200.memory_bandwidth) == (3.35e12, 4.8e12)  # datasheets: no measurement cited
    sweep = a100.intra.sweep  # nccl-tests all_reduce_perf on one 8x A100 node, 32 KiB to 16 GiB by doubling
    assert [size for size, _ in sweep] == [2**k for k in range(15, 35)]
    assert (
        (sweep[0][1], sweep[11][1], sweep[-1][1])
        == (1.31e9, 171.54e9, 234.89e9)
        == (sweep[0][1], sweep[11][1], a100.intra.bandwidth)
    )
    assert not (h100.intra.sweep or h200.intra.sweep or a100.inter.sweep)  # H200's published sweep runs NVLS
    assert h200.peak_flops == h100.peak_flops and h200.intra == h100.intra and h200.inter == h100.inter


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="a100-80gb, h100-sxm, h200") as refused:
        load("b200")
    assert "'b200'" in str(refused.value)


def refusal(text: str) -> str:
    """What parse says refusing ``text`` as the file cluster.json (it names the file first)."""
    with pytest.raises(ValueError) as refused:
        parse(text, "cluster.json")
    message = str(refused.value)
    assert message.startswith("cluster.json: ")
    return message


def broken(change: Callable[[dict[str, Any]], object]) -> str:
    """The refusal of the a100 preset's JSON changed in place by ``change``."""
    data = load("a100-80gb").to_json()
    change(data)
    return refusal(json.dumps(data))


def garbled(change: Callable[[str], str]) -> str:
    """The refusal of the a100 preset's JSON text changed by ``change``."""
    return refusal(change(json.dumps(load("a100-80gb").to_json())))


def test_a_missing_field_is_named() -> None:
    message = broken(lambda data: data.pop("memory_bandwidth"))
    assert "memory_bandwidth is missing; write the memory bandwidth in bytes/s" in message
    assert "inter.latency is missing" in broken(lambda data: data["inter"].pop("latency"))
    assert "peak_flops.bf16 is missing" in broken(lambda data: data["peak_flops"].pop("bf16"))
    assert "sources.intra.bandwidth is missing; write where the figure comes from" in broken(
        lambda data: data["sources"].pop("intra.bandwidth")
    )


def test_a_wrong_number_is_named_with_its_value_and_rule() -> None:
    def set_(path: str, value: object) -> Callable[[dict[str, Any]], None]:
        def change(data: dict[str, Any]) -> None:
            *outer, last = path.split(".")
            for key in outer:
                data = data[key]
            data[last] = value

        return change

    message = broken(set_("intra.bandwidth", -1e9))
    assert "intra.bandwidth = -1000000000.0 is refused: not a positive, finite number" in message
    assert "write the NCCL bus bandwidth per GPU in bytes/s" in message
    message = broken(set_("memory_bytes", "80e9"))
    assert 'memory_bytes = "80e9" is refused' in message and "text; a number is written without quotes" in message
    assert "devices_per_node = 0 is refused: not a whole number, 1 or more" in broken(set_("devices_per_node", 0))
    assert "devices_per_node = 8.0 is refused" in broken(set_("devices_per_node", 8.0))
    assert "peak_flops.fp32 = true is refused" in broken(set_("peak_flops.fp32", True))
    assert "matmul_efficiency = 1.5 is refused: larger than 1" in broken(set_("matmul_efficiency", 1.5))
    assert "inter.latency = 0 is refused" in broken(set_("inter.latency", 0))
    message = garbled(lambda text: text.replace('"latency": 1.4e-05', '"latency": NaN'))
    assert "inter.latency = NaN is refused: not a positive, finite number" in message
    assert 'sources.peak_flops = "" is refused: not text' in broken(set_("sources.peak_flops", ""))


def test_unknown_and_twice_written_keys_are_refused() -> None:
    message = broken(lambda data: data.update(memory_bandwith=1.0))
    assert "memory_bandwith is not a field here" in message and "correct its spelling" in message
    message = garbled(lambda text: text.replace('"fp32":', '"bf16": 1.0, "fp32":'))
    assert "the key 'bf16' is written twice in one object" in message
    assert "the file = [1, 2] is refused: not a JSON object" in refusal("[1, 2]")
    assert "cannot be read as a hardware description" in refusal("{")


def test_a_file_is_refused_naming_its_path(tmp_path: Path) -> None:
    described = load("h100-sxm").to_json()
    described["intra"]["bandwidth"] = 0
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(described))
    with pytest.raises(ValueError, match=f"^{path}: intra.bandwidth = 0 is refused"):
        load(path)
    with pytest.raises(ValueError, match=r"absent\.json': no such file \(a hardware description is a JSON file"):
        load(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="'b300' is neither a preset nor a hardware description file"):
        load("b300")


def test_a_description_built_in_code_is_held_to_the_same_rules() -> None:
    with pytest.raises(ValueError, match="bandwidth = -1 is refused"):
        Link(bandwidth=-1, latency=1e-6)
    with pytest.raises(ValueError, match="Hardware 'x': peak_flops.tf32 is missing"):
        Hardware(
            "x",
            8,
            80e9,
            2e12,
            {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0},
            0.5,
            FAST,
            SLOW,
            dict.fromkeys(FIGURES, "assumed"),
        )
    assert hash(load("h200")) == hash(load("h200"))  # a cache key for the planner


def test_a_sweep_is_refused_naming_the_point_and_needs_a_source() -> None:
    def set_sweep(value: object) -> Callable[[dict[str, Any]], None]:
        return lambda data: data["intra"].update(sweep=value)

    message = broken(set_sweep([[2e6, 1e9], [1e6, 2e9]]))
    assert "intra.sweep = [2000000.0, 1000000.0] is refused: the sizes are not strictly ascending" in message
    assert "write a measured all_reduce as nccl-tests' all_reduce_perf prints it" in message
    assert "intra.sweep[1] = [1000000.0] is refused: not a pair [bytes, busbw]" in broken(set_sweep([[1, 2], [1e6]]))
    assert "intra.sweep[0][1] = -1 is refused" in broken(set_sweep([[1, -1], [2, 3]]))
    assert "intra.sweep = [[1, 2]] is refused: not a list of two measured sizes or more" in broken(set_sweep([[1, 2]]))
    message = broken(lambda data: (data["sources"].pop("intra.sweep"), data["inter"].update(sweep=[[1, 2], [3, 4]])))
    assert "sources.intra.sweep is missing" in message
    assert "sources.inter.sweep is missing" in broken(lambda data: data["inter"].update(sweep=[[1, 2], [3, 4]]))
    data = load("a100-80gb").to_json()
    data["intra"].pop("sweep")
    assert parse(json.dumps(data), "no sweep").intra.sweep == ()  # optional: its source may stay


def test_a_measured_sweep_bounds_every_collective_from_below_by_hand() -> None:
    # measured: 1 MB at 10 GB/s busbw (1e-4 s of bus time), 100 MB at 50 GB/s (2e-3 s); the line says 100 GB/s
    swept = Link(bandwidth=100e9, latency=1e-6, sweep=((1e6, 10e9), (1e8, 50e9)))
    between = 1e-4 + (5e7 - 1e6) * (2e-3 - 1e-4) / (1e8 - 1e6)  # the line between the two measured sizes
    assert swept.bus_seconds(5e7) == pytest.approx(between)
    assert all_reduce(5e7, 8, swept) == pytest.approx(2 * 7 / 8 * between)  # slower than the line's 0.89 ms
    assert all_gather(5e7, 4, swept) == reduce_scatter(5e7, 4, swept) == pytest.approx(3 / 4 * between)
    assert send_recv(5e7, swept) == pytest.approx(between)
    assert all_reduce(1e3, 2, swept) == pytest.approx(1e-4)  # below the smallest: its time, a floor
    assert all_reduce(1e9, 2, swept) == pytest.approx(2e-3 + 9e8 / 50e9)  # past the largest: at its busbw
    fast = Link(bandwidth=10e9, latency=1e-3, sweep=((1e6, 100e9), (1e8, 100e9)))  # a sweep faster than the line
    assert all_reduce(1e8, 8, fast) == pytest.approx(14e-3 + 2 * 7 / 8 * 1e8 / 10e9)  # the line holds
    assert Link(100e9, 1e-6).bus_seconds(1e6) is None


def test_collectives_cost_by_hand_on_injected_links() -> None:
    gb = 1e9
    # all-reduce of 1 GB over 8 ranks on 100 GB/s, 5 us: a ring's 14 steps and 2 * 7/8 of the buffer
    assert all_reduce(gb, 8, FAST) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * gb / 100e9)
    # a tree: 2 * ceil(log2 8) = 6 steps, the ring's bandwidth term
    assert all_reduce(gb, 8, FAST, algorithm="tree") == pytest.approx(6 * 5e-6 + 2 * 7 / 8 * gb / 100e9)
    assert all_reduce(gb, 6, FAST, algorithm="tree") == pytest.approx(6 * 5e-6 + 2 * 5 / 6 * gb / 100e9)
    assert all_reduce(0, 64, SLOW) == pytest.approx(126 * 20e-6)  # latency alone: 2(n-1) steps
    assert all_reduce(0, 64, SLOW, algorithm="tree") == pytest.approx(12 * 20e-6)
    # all-gather and reduce-scatter of a 1 GB buffer in all: 7 steps, 7/8 of it
    assert all_gather(gb, 8, FAST) == pytest.approx(7 * 5e-6 + 7 / 8 * gb / 100e9)
    assert reduce_scatter(gb, 8, SLOW) == pytest.approx(7 * 20e-6 + 7 / 8 * gb / 25e9)
    # a reduce-scatter then an all-gather is a ring all-reduce, steps and bytes
    assert reduce_scatter(gb, 8, FAST) + all_gather(gb, 8, FAST) == pytest.approx(all_reduce(gb, 8, FAST))
    assert send_recv(gb, SLOW) == pytest.approx(20e-6 + gb / 25e9)
    assert all_reduce(gb, 1, FAST) == all_gather(gb, 1, FAST) == reduce_scatter(gb, 1, FAST) == 0.0
    for nbytes, n in ((-1.0, 8), (math.inf, 8), (1.0, 0), (1.0, 2.0)):
        with pytest.raises(ValueError, match="nbytes = -1.0|nbytes = inf|n = 0|n = 2.0"):
            all_reduce(nbytes, n, FAST)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not one of 'ring', 'tree'"):
        all_reduce(gb, 8, FAST, algorithm="nvls")  # type: ignore[arg-type]


def test_group_link_intra_where_every_group_fits_a_node() -> None:
    hw = machine(devices_per_node=8)
    tp, pp = 8, 4
    assert group_link(hw, tp, 1) == FAST  # tp = 8: one node
    assert group_link(hw, 4, 1) == FAST and group_link(hw, 2, 4) == FAST  # tp = 4; pp = 2 over tp = 4
    assert group_link(hw, 1, 64) == FAST  # a group of one moves nothing
    # pp over tp = 8 and dp over tp * pp = 32: one member a node, each member's own NIC
    assert group_link(hw, pp, tp) == SLOW
    assert group_link(hw, 16, tp * pp) == SLOW


def test_group_link_spanning_nodes_counts_the_nics_of_its_members_per_node() -> None:
    hw = machine(devices_per_node=8)
    # dp = 16 over tp = 2: 4 members a node on 4 nodes; their 4 NICs carry the ring, 4 * 25 = 100 GB/s, NVLink's
    # bound; 2(4-1) of a ring's 2(16-1) steps cross nodes
    link = group_link(hw, 16, 2)
    assert link.bandwidth == pytest.approx(min(100e9, 4 * 25e9))
    assert link.latency == pytest.approx((12 * 5e-6 + 3 * 20e-6) / 15)
    # dp = 64 with tp = pp = 1: 8 members a node, 8 * 25 GB/s > NVLink's 100: the node's link bounds it
    assert group_link(hw, 64, 1).bandwidth == pytest.approx(100e9)
    # tp = 3 on 8-GPU nodes: the group {6, 7, 8} straddles two nodes, with one member in the second
    straddling = group_link(hw, 3, 1)
    assert straddling.bandwidth == pytest.approx(25e9)
    assert straddling.latency == pytest.approx((1 * 5e-6 + 1 * 20e-6) / 2)
    for wrong in ((0, 1), (2, 0), (True, 1)):
        with pytest.raises(ValueError, match="not a whole number"):
            group_link(hw, *wrong)
