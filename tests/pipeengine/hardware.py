"""A GPU machine with injected figures, for pricing layouts by hand: both link tiers one Link, a matmul rate of
100 TFLOP/s (bf16 and fp16 peaks of 200 at an efficiency of 0.5), fp32's 10."""

from __future__ import annotations

from pipeengine.planner.cluster import Hardware, Link, load

LINK = Link(bandwidth=100e9, latency=1e-9)  # latency: a nanosecond a step (it must be positive)


def injected(memory: float = 80e9, memory_bandwidth: float = 1e12) -> Hardware:
    described = load("a100-80gb").to_json()
    described.update(
        intra=LINK.to_json(),
        inter=LINK.to_json(),
        memory_bytes=memory,
        memory_bandwidth=memory_bandwidth,
        matmul_efficiency=0.5,
        peak_flops={"fp32": 10e12, "tf32": 100e12, "bf16": 200e12, "fp16": 200e12},
    )
    return Hardware.from_json(described, "test")
