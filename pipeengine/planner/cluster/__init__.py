"""A GPU cluster described as data (presets/*.json) and the price of NCCL collectives on its links."""

from pipeengine.planner.cluster.hardware import PRESETS, Hardware, Link, load

__all__ = ["PRESETS", "Hardware", "Link", "load"]
