"""The time of an NCCL collective over a group of ranks on one tier of links, priced from a hardware description.

Why this form: a link's figure is NCCL's bus bandwidth ("busbw"), which nccl-tests define so that it does not
depend on the number of ranks (NVIDIA/nccl-tests, doc/PERFORMANCE.md, "Bus bandwidth"): from the algorithm
bandwidth ``algbw = S / t`` of a collective of ``S`` bytes over ``n`` ranks,

- all_reduce: ``busbw = algbw * 2(n-1)/n`` (each element needs n-1 additions and n assignments, 2(n-1) transfers
  shared by n links);
- reduce_scatter and all_gather: ``busbw = algbw * (n-1)/n``, where S is the whole array (NCCL's
  ``recvcount * sizeof(datatype) * n`` for reduce_scatter, ``sendcount * sizeof(datatype) * n`` for all_gather);
- send/recv (and broadcast, reduce): ``busbw = algbw``.

So the bandwidth term of each is its factor times ``S / busbw``; the latency term counts NCCL's algorithm steps, as
NCCL's own tuner does (NVIDIA/nccl src/graph/tuning.cc: ``nsteps = 2 * (nRanks - 1)`` for a ring all_reduce,
``nRanks - 1`` for all_gather and reduce_scatter): ``time = steps * link.latency + factor * S / link.bandwidth``.

- ring all_reduce: 2(n-1) steps; ring all_gather, reduce_scatter: n-1 steps;
- tree all_reduce: 2 ceil(log2 n) steps (up the tree, then down), the ring's bandwidth term.

Where the link carries a measured sweep (``Link.sweep``: an all_reduce timed over sizes, as nccl-tests'
all_reduce_perf prints it), a collective takes at least its factor times the sweep's ``S / busbw`` at its size S
(``Link.bus_seconds``), the larger of that and the line above. Why: busbw is far from its plateau at the sizes a
step moves (Stas Bekman's sweep on one 8x A100 node, network/README.md, "Real network throughput": 171.5 GB/s at 64
MiB, 229.0 at 1 GiB, 234.9 at 16 GiB), which a latency and one bandwidth cannot both follow. The sweep is one
all_reduce's; all_gather, reduce_scatter and send/recv read it at their own S (busbw is defined to be the same
figure for each: nccl-tests' PERFORMANCE.md), and a group of another size than the one swept reads it too.

What is left out, knowingly: NCCL's fixed launch cost per collective (``baseLatencies``, some 7-8 us), its choice
of protocol by size (LL's lower latency and bandwidth for small messages; the figures here are the Simple
protocol's, that of the large transfers training makes), NVLink SHARP (NVLS, which lifts an all_reduce within an
H100/H200 node past the ring's bound), and that NCCL's trees are chains inside a node (its tree latency is
``2 * ((ranks per node - 1) * intra + log2(nodes) * inter)``), so within a node the ring's step count is the closer
one. The tree here is a binary tree over all ranks.

Which link a group uses, ``group_link``: ranks are laid out with tensor parallelism innermost, ``rank = ((d * pp) +
p) * tp + t``, and nodes filled in rank order, so a group of g ranks ``stride`` apart (tp: 1, pp: tp, dp: tp * pp)
lies in one node for every such group exactly when ``g * stride`` divides the node's devices; then it uses the
node's link (``hw.intra``). Otherwise it spans nodes. With one member per node, each member's NIC carries the ring:
``hw.inter``. With m members per node, NCCL's channels cross the node boundary at different GPUs, so the node's m
NICs carry the inter-node traffic together and the bound is ``min(intra, m * inter)`` per GPU, not one NIC's rate:
Stas Bekman, Machine Learning Engineering, network/README.md, "Inter-node speed depends on intra-node speed",
measured a 4-node 8x B200 all_reduce at 377 GB/s busbw, where one NIC's 50 GB/s ("the arithmetic to avoid") is 3.9x
too slow and a ring over the node's 8 x 50 GB/s is within 6%. The latency of a spanning ring is NCCL's mix
(tuning.cc: ``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat``, 2(k-1) of the 2(n-1) steps crossing
nodes for k nodes): per step ``((n - k) * intra + (k - 1) * inter) / (n - 1)``, all ``inter`` with one member per
node.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Literal

from pipeengine.planner.cluster.hardware import Hardware, Link

__all__ = ["Algorithm", "all_gather", "all_reduce", "group_link", "reduce_scatter", "send_recv"]

Algorithm = Literal["ring", "tree"]


def _checked(nbytes: float, n: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes = {nbytes!r}: not a finite number of bytes >= 0")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n = {n!r}: not a whole number of ranks, 1 or more")


def all_reduce(nbytes: float, n: int, link: Link, algorithm: Algorithm = "ring") -> float:
    """Seconds to all-reduce ``nbytes`` (each rank's buffer) over ``n`` ranks on ``link``: 2(n-1) steps on a ring,
    2 ceil(log2 n) on a tree; either moves 2(n-1)/n * nbytes per rank at the link's bus bandwidth."""
    _checked(nbytes, n)
    if algorithm == "ring":
        steps = 2 * (n - 1)
    elif algorithm == "tree":
        steps = 2 * math.ceil(math.log2(n))
    else:
        raise ValueError(f"algorithm = {algorithm!r}: not one of 'ring', 'tree'")
    return _seconds(steps, 2 * (n - 1) / n, nbytes, link)


def _seconds(steps: int, factor: float, nbytes: float, link: Link) -> float:
    """``steps`` latencies and ``factor * nbytes`` at the bus bandwidth, or the link's measured sweep at that size
    where it says longer (the module's docstring)."""
    seconds = steps * link.latency + factor * nbytes / link.bandwidth
    swept = link.bus_seconds(nbytes)
    return seconds if swept is None else max(seconds, factor * swept)


def all_gather(nbytes: float, n: int, link: Link) -> float:
    """Seconds to all-gather over ``n`` ranks into a buffer of ``nbytes`` in all (each rank gives nbytes / n), on a
    ring: n-1 steps, (n-1)/n * nbytes per rank at the link's bus bandwidth."""
    _checked(nbytes, n)
    return _seconds(n - 1, (n - 1) / n, nbytes, link)


def reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    """Seconds to reduce-scatter ``nbytes`` in all (each rank's input; each keeps nbytes / n) over ``n`` ranks, on a
    ring: n-1 steps, (n-1)/n * nbytes per rank at the link's bus bandwidth."""
    _checked(nbytes, n)
    return _seconds(n - 1, (n - 1) / n, nbytes, link)


def send_recv(nbytes: float, link: Link) -> float:
    """Seconds to send ``nbytes`` from one rank to another on ``link``: one step (busbw = algbw)."""
    _checked(nbytes, 2)
    return _seconds(1, 1.0, nbytes, link)


def group_link(hw: Hardware, group_size: int, stride_in_ranks: int) -> Link:
    """The link a group of ``group_size`` ranks, ``stride_in_ranks`` apart, collects over on ``hw``'s nodes (ranks
    laid out tp innermost, nodes filled in rank order; see the module's docstring): ``hw.intra`` where every such
    group lies in one node, else one priced from ``hw.inter`` and the slowest group's members per node."""
    for name, value in (("group_size", group_size), ("stride_in_ranks", stride_in_ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: not a whole number, 1 or more")
    node, block = hw.devices_per_node, group_size * stride_in_ranks
    if group_size == 1 or node % block == 0:
        return hw.intra
    fewest, nodes = _spread(node, group_size, stride_in_ranks)
    latency = ((group_size - nodes) * hw.intra.latency + (nodes - 1) * hw.inter.latency) / (group_size - 1)
    sweep = hw.inter.sweep if fewest == 1 else ()  # as measured (one rank a node); m a node share m NICs: unmeasured
    return Link(bandwidth=min(hw.intra.bandwidth, fewest * hw.inter.bandwidth), latency=latency, sweep=sweep)


@functools.lru_cache(maxsize=1024)
def _spread(node: int, group_size: int, stride: int) -> tuple[int, int]:
    """(members per node, nodes) of the group spanning nodes with the fewest members on some node: the groups repeat
    every lcm(block, node) ranks, so each one's members per node are counted there (once per shape: a search asks
    the same shapes of thousands of layouts)."""
    block = group_size * stride
    members: dict[int, Counter[int]] = {}
    for rank in range(math.lcm(block, node)):
        group = rank // block * stride + rank % stride
        members.setdefault(group, Counter())[rank // node] += 1
    return min((min(count.values()), len(count)) for count in members.values() if len(count) > 1)
