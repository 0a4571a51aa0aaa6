"""A GPU machine as data: one accelerator's figures and the two link tiers between accelerators.

Why data: issue 59's planner prices a layout for hundreds or thousands of GPUs from a laptop, so nothing can be
measured where it runs; "a model of the machine is data (a hardware description), not constants measured here".
A description is a JSON file (``load(path)``) or one of the presets shipped beside this module
(``presets/*.json``: a100-80gb, h100-sxm, h200), and every figure in it carries the source it was taken from
(``sources``, keyed by the figure's path: "intra.bandwidth"), so a reader can tell a datasheet figure from a
measured one and from an assumption. A file is checked as it is read: a field missing, unknown, or written twice, a
number written as text, zero, negative, NaN or infinite is refused naming the file, the field's path, its value,
the rule and what to write instead, not with a ZeroDivisionError when a layout is priced.

The figures' meanings, chosen so the pricing in ``collectives`` needs no other constant:

- ``peak_flops``: dense FLOP/s by dtype from the datasheet (no 2:4 sparsity; NVIDIA's headline figures for TF32,
  BF16 and FP16 are with sparsity, twice the dense ones).
- ``matmul_efficiency``: the measured fraction of the BF16/FP16 peak a large matmul reaches (Stas Bekman's
  "Maximum Achievable Matmul FLOPS", MAMF, is the reference measurement; see each preset's sources).
- ``Link.bandwidth``: NCCL bus bandwidth per GPU in bytes/s, "busbw" as nccl-tests define it
  (NVIDIA/nccl-tests doc/PERFORMANCE.md: the figure that "should reflect the speed of the hardware bottleneck",
  independent of the number of ranks); ``Link.latency``: seconds per algorithm step (one hop of a ring or tree).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from pipeengine.core.files import once_each

__all__ = ["DTYPES", "FIGURES", "PRESETS", "Hardware", "Link", "load", "parse"]

DTYPES = ("fp32", "tf32", "bf16", "fp16")  # peak_flops must name these; others (fp8, ...) may follow
FIELDS = (
    "name",
    "devices_per_node",
    "memory_bytes",
    "memory_bandwidth",
    "peak_flops",
    "matmul_efficiency",
    "intra",
    "inter",
    "sources",
)
LINK_FIELDS = ("bandwidth", "latency")
SWEPT = ("intra.sweep", "inter.sweep")  # a link's optional measured sweep, which then needs a source too
# every figure a description holds, by its path: each needs a source (which may say "assumed")
FIGURES = (
    "devices_per_node",
    "memory_bytes",
    "memory_bandwidth",
    "peak_flops",
    "matmul_efficiency",
    "intra.bandwidth",
    "intra.latency",
    "inter.bandwidth",
    "inter.latency",
)

POSITIVE = "not a positive, finite number"
CITED = 'where the figure comes from (a datasheet, a measurement, or "assumed" and why)'
# what to write for each figure, said in the refusal of a wrong one
WANTED = {
    "devices_per_node": "a whole number of accelerators in one node, 1 or more (8 on a DGX/HGX node)",
    "memory_bytes": "the accelerator's memory in bytes (80e9 for 80 GB)",
    "memory_bandwidth": "the memory bandwidth in bytes/s a kernel reaches: measured (1.80e12), else the datasheet's "
    "(2.039e12 for 2,039 GB/s), an upper bound",
    "peak_flops": "dense FLOP/s by dtype from the datasheet, without sparsity (312e12 for 312 TFLOPS)",
    "matmul_efficiency": "the measured fraction of the bf16/fp16 peak a large matmul reaches, in (0, 1] (0.869)",
    "bandwidth": "the NCCL bus bandwidth per GPU in bytes/s, busbw as nccl-tests define it (2.35e11 for 235 GB/s)",
    "latency": "seconds per algorithm step (3.4e-6 for 3.4 us)",
    "sweep": "a measured all_reduce as nccl-tests' all_reduce_perf prints it, [[bytes, busbw in bytes/s], ...] with "
    "the sizes ascending, two or more",
    "intra": 'the link within a node: {"bandwidth": bytes/s, "latency": s}',
    "inter": 'the link across nodes, per GPU: {"bandwidth": bytes/s, "latency": s}',
    "sources": "where each figure comes from, by its path",
    "name": "the accelerator's name",
}


def _shown(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (str, bool, int, float, type(None))) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refused(where: str, path: str, value: object, rule: str) -> ValueError:
    key = "peak_flops" if path.startswith("peak_flops.") else path.rsplit(".", 1)[-1].split("[")[0]  # intra.latency:
    # latency; intra.sweep[2][1]: sweep
    return ValueError(f"{where}: {path} = {_shown(value)} is refused: {rule}; write {WANTED[key]}")


def _number(where: str, path: str, value: object, at_most: float | None = None) -> float:
    """``value`` as a float where it is a positive finite JSON number (not text, not true/false) and, with
    ``at_most``, no larger; else a ValueError naming ``where`` and ``path``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "text" if isinstance(value, str) else "true/false" if isinstance(value, bool) else "not a number"
        raise _refused(where, path, value, f"{POSITIVE} ({kind}; a number is written without quotes)")
    if not math.isfinite(value) or value <= 0:
        raise _refused(where, path, value, POSITIVE)
    if at_most is not None and value > at_most:
        raise _refused(where, path, value, f"larger than {at_most:g}")
    return float(value)


def _whole(where: str, path: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refused(where, path, value, "not a whole number, 1 or more")
    return value


def _object(
    where: str, path: str, value: object, known: tuple[str, ...], extra: bool = False, optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``value`` as a dict holding every key of ``known`` (and, unless ``extra``, no other but those of
    ``optional``), else a ValueError."""
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: {path or 'the file'} = {_shown(value)} is refused: not a JSON object; write an "
            f"object with {', '.join(map(json.dumps, known))}"
        )
    prefix = f"{path}." if path else ""
    for key in known:
        if key not in value:
            wanted = {"peak_flops": WANTED["peak_flops"], "sources": CITED}.get(path, WANTED.get(key, "it"))
            raise ValueError(f"{where}: {prefix}{key} is missing; write {wanted}")
    if not extra:
        unknown = [key for key in value if key not in known and key not in optional]
        if unknown:
            fields = ", ".join(known + optional)
            raise ValueError(
                f"{where}: {prefix}{unknown[0]} is not a field here (fields: {fields}); "
                "remove it or correct its spelling"
            )
    return value


@dataclass(frozen=True)
class Link:
    """One tier of links between accelerators as NCCL sees it: a bus bandwidth and a latency a step and, where
    measured, the sweep of an all-reduce over sizes (``bus_seconds``)."""

    bandwidth: float  # bytes/s: NCCL bus bandwidth per GPU ("busbw" as nccl-tests define it)
    latency: float  # s per algorithm step (one hop of a ring or a tree)
    sweep: tuple[tuple[float, float], ...] = ()  # measured (bytes, busbw) of an all_reduce, the sizes ascending

    def __post_init__(self) -> None:
        _number("Link", "bandwidth", self.bandwidth)
        _number("Link", "latency", self.latency)
        _sweep("Link", "sweep", self.sweep)

    def bus_seconds(self, nbytes: float) -> float | None:
        """``nbytes / busbw`` at that size as the sweep measured it (None without one): the line between the two
        measured sizes around ``nbytes``; below the smallest, the smallest's (a latency floor: nothing smaller
        was timed); past the largest, the largest's and the rest at its bus bandwidth. A collective's time is at
        least its bandwidth factor times this (collectives' docstring)."""
        if not self.sweep:
            return None
        points = [(size, size / busbw) for size, busbw in self.sweep]
        if nbytes <= points[0][0]:
            return points[0][1]
        for (low, low_s), (high, high_s) in zip(points, points[1:], strict=False):
            if nbytes <= high:
                return low_s + (nbytes - low) * (high_s - low_s) / (high - low)
        return points[-1][1] + (nbytes - points[-1][0]) / self.sweep[-1][1]

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"bandwidth": self.bandwidth, "latency": self.latency}
        if self.sweep:
            found["sweep"] = [list(point) for point in self.sweep]
        return found

    @classmethod
    def from_json(cls, data: object, where: str, path: str) -> Link:
        record = _object(where, path, data, LINK_FIELDS, optional=("sweep",))
        bandwidth, latency = (_number(where, f"{path}.{key}", record[key]) for key in LINK_FIELDS)
        return cls(bandwidth, latency, _sweep(where, f"{path}.sweep", record.get("sweep", ())))


def _sweep(where: str, path: str, value: object) -> tuple[tuple[float, float], ...]:
    """A measured sweep as a tuple of (bytes, busbw): two points or more, each two positive numbers, the sizes
    strictly ascending; empty where there is none."""
    if isinstance(value, (list, tuple)) and not value:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        raise _refused(where, path, value, "not a list of two measured sizes or more")
    points = []
    for number, point in enumerate(value):
        if not isinstance(point, (list, tuple)) or len(point) != 2:
            raise _refused(where, f"{path}[{number}]", point, "not a pair [bytes, busbw]")
        points.append(
            (_number(where, f"{path}[{number}][0]", point[0]), _number(where, f"{path}[{number}][1]", point[1]))
        )
    sizes = [size for size, _ in points]
    if any(high <= low for low, high in zip(sizes, sizes[1:], strict=False)):
        raise _refused(where, path, sizes, "the sizes are not strictly ascending")
    return tuple(points)


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and its node: what the planner prices compute, memory and collectives with."""

    name: str
    devices_per_node: int
    memory_bytes: float  # bytes of accelerator memory (datasheet; decimal GB unless its source says otherwise)
    memory_bandwidth: float  # bytes/s, datasheet
    peak_flops: dict[str, float] = field(hash=False)  # dense FLOP/s by dtype "fp32", "tf32", "bf16", "fp16"
    matmul_efficiency: float  # achieved fraction of the bf16/fp16 peak for large matmuls, measured (cited)
    intra: Link  # within a node (NVLink/NVSwitch)
    inter: Link  # across nodes (InfiniBand): per GPU, one NIC each
    sources: dict[str, str] = field(hash=False)  # where each figure (by its path, FIGURES) comes from

    def __post_init__(self) -> None:
        for tier in ("intra", "inter"):
            if not isinstance(getattr(self, tier), Link):
                raise ValueError(f"Hardware {self.name!r}: {tier} = {getattr(self, tier)!r} is not a Link")
        _values(self.to_json(), f"Hardware {self.name!r}")  # one built in code is held to the rules a file is

    def to_json(self) -> dict[str, Any]:
        """The description as a JSON object, read back equal by from_json."""
        return {
            "name": self.name,
            "devices_per_node": self.devices_per_node,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "peak_flops": dict(self.peak_flops),
            "matmul_efficiency": self.matmul_efficiency,
            "intra": self.intra.to_json(),
            "inter": self.inter.to_json(),
            "sources": dict(self.sources),
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> Hardware:
        """The description in ``data`` (a parsed JSON object), refused with a ValueError naming ``where`` (the
        file), the field's path, its value, the rule it breaks and what to write instead."""
        return cls(**_values(data, where))


def _values(data: object, where: str) -> dict[str, Any]:
    """Hardware's fields read from the JSON object ``data``, each checked (Hardware.from_json)."""
    record = _object(where, "", data, FIELDS)
    name = record["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name = {_shown(name)} is refused: not a name; write the accelerator's name")
    peaks = _object(where, "peak_flops", record["peak_flops"], DTYPES, extra=True)
    sources = _object(where, "sources", record["sources"], FIGURES, optional=SWEPT)
    for key, text in sources.items():
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: sources.{key} = {_shown(text)} is refused: not text; write {CITED}")
    found: dict[str, Any] = {
        "name": name,
        "devices_per_node": _whole(where, "devices_per_node", record["devices_per_node"]),
        "memory_bytes": _number(where, "memory_bytes", record["memory_bytes"]),
        "memory_bandwidth": _number(where, "memory_bandwidth", record["memory_bandwidth"]),
        "peak_flops": {str(k): _number(where, f"peak_flops.{k}", v) for k, v in peaks.items()},
        "matmul_efficiency": _number(where, "matmul_efficiency", record["matmul_efficiency"], at_most=1.0),
        "intra": Link.from_json(record["intra"], where, "intra"),
        "inter": Link.from_json(record["inter"], where, "inter"),
        "sources": dict(sources),
    }
    for tier in ("intra", "inter"):
        if found[tier].sweep and f"{tier}.sweep" not in sources:
            raise ValueError(f"{where}: sources.{tier}.sweep is missing; write {CITED}")
    return found


def parse(text: str, where: str) -> Hardware:
    """The description in JSON ``text`` read from ``where``: refused if it is not JSON, writes a key twice, or
    breaks a rule of Hardware.from_json."""
    try:
        data = json.loads(text, object_pairs_hook=once_each)
    except ValueError as error:  # not JSON, or a key written twice
        raise ValueError(f"{where}: cannot be read as a hardware description ({error}); correct the file") from error
    return Hardware.from_json(data, where)


_PRESETS = files("pipeengine.planner.cluster") / "presets"
PRESETS: tuple[str, ...] = tuple(sorted(p.name[:-5] for p in _PRESETS.iterdir() if p.name.endswith(".json")))


def load(name_or_path: str | os.PathLike[str]) -> Hardware:
    """The preset named ``name_or_path`` (PRESETS: "a100-80gb", "h100-sxm", "h200") or the description in the
    JSON file at that path."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        preset = _PRESETS / f"{name_or_path}.json"
        return parse(preset.read_text(encoding="utf-8"), f"preset {name_or_path} ({preset})")
    path = Path(name_or_path)
    if not path.is_file() and (path.suffix == ".json" or len(path.parts) > 1):  # meant as a file
        raise ValueError(
            f"{str(name_or_path)!r}: no such file (a hardware description is a JSON file written like "
            f"the presets; or name one of {', '.join(PRESETS)})"
        )
    if not path.is_file():
        raise ValueError(
            f"{str(name_or_path)!r} is neither a preset nor a hardware description file: name one of "
            f"{', '.join(PRESETS)}, or the path of a JSON file written like them"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot be read ({type(error).__name__}: {error})") from error
    return parse(text, str(path))
