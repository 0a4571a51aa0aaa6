"""A GPU cluster described as data (presets/*.json) and the price of NCCL collectives on its links."""

from pipeengine.planner.cluster.collectives import all_gather, all_reduce, group_link, reduce_scatter, send_recv
from pipeengine.planner.cluster.hardware import PRESETS, Hardware, Link, load

__all__ = [
    "PRESETS",
    "Hardware",
    "Link",
    "all_gather",
    "all_reduce",
    "group_link",
    "load",
    "reduce_scatter",
    "send_recv",
]
