"""A calibration file's record checked before pipeengine.planner.calibration reads it (``check``, ``measured``).

Every field the planner prices with is refused, by its path in the JSON (``collectives["all_reduce"]["2"][1][0]``),
with its value and the rule it breaks, where it is not what ``calibration.save`` writes: a number as text, true, NaN or
infinite, below zero; a curve measured twice at one size or out of order (the planner would divide by the gap between
two sizes); a collective or a step's frame over fewer than 2 ranks (it would divide by the rounds of a ring of one); a
group size not written as a whole number. So an odd file is refused as it is read, not with a ZeroDivisionError when
a layout is priced.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["check", "measured"]

SECONDS = "not a number of seconds >= 0"
BYTES = "not a positive number of bytes"
PAIR = "not a [latency, seconds per byte] pair"
FRAMES = ("pipeline", "replicas")


def measured(data: object) -> str:
    """ "HOST at DATE": where and when a kept file's record was measured; a ValueError if it has none."""
    record = _record(data)
    for key in ("host", "date"):
        if not isinstance(record.get(key), str):
            raise _refused(
                key,
                record,
                "not the name of the machine measured on" if key == "host" else "not the date it was measured on",
            )
    return f"{record['host']} at {record['date']}"


def check(data: object, version: int, ops: Sequence[str]) -> None:
    """A ValueError naming the first field of ``data`` that Prices.from_json cannot read or price with (its path in
    the JSON, its value, the rule), or a ``format`` other than ``version``; ``ops``: the collectives priced."""
    record = _record(data)
    found = record.get("format", 1)
    if isinstance(found, bool) or not isinstance(found, int):
        raise _refused("format", record, "not a format number")
    if found != version:
        written = (
            "an earlier pipeengine (this one reads {0}, which also prices a step's frame, posting, copying and "
            "FSDP2's extras)"
            if found < version
            else "a later pipeengine (this one reads {0})"
        )
        raise ValueError(f"it is of format {found}, written by {written.format(version)}")
    _number(record, "overhead", SECONDS)
    _number(record, "copy", SECONDS)
    _pair(record, "p2p", PAIR)
    _pair(record, "post", "not a [seconds per post, seconds per message] pair")
    fsdp = _object(record, "fsdp", '"hooks", "gather" and "reduce"', ("hooks", "gather", "reduce"))
    _pair(fsdp, "hooks", "not a [forward seconds, backward seconds] pair", "fsdp")
    for name in ("gather", "reduce"):
        _groups(fsdp, name, lambda table, key, where: _number(table, key, SECONDS, where), "fsdp")
    frame = _object(record, "frame", "at most " + " and ".join(map(json.dumps, FRAMES)), FRAMES, required=False)
    for name in frame:
        _groups(frame, name, lambda table, key, where: _number(table, key, SECONDS, where), "frame")
    for name in ("collectives", "crowded"):
        if name in record:
            table = _object(record, name, "ops among " + ", ".join(ops), tuple(ops), required=False)
            for op in table:
                _groups(table, op, _price, name)
    if record.get("processors") is not None:
        _number(record, "processors", "not a positive number of ranks", positive=True)
    world = record.get("world_size")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 2):
        raise _refused("world_size", record, "not a whole number of ranks, 2 or more (calibration runs on 2 or more)")
    points = record.get("wake", [])
    if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
        raise _refused("wake", record, "not a list of [compute seconds, delay seconds] pairs")
    for index in range(len(points)):
        for part in (0, 1):
            _number(points[index], part, SECONDS, f"wake[{index}]")


def _record(data: object) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"it holds {_shown(data)}: not a JSON object of prices")
    return data


def _path(where: str, key: str | int) -> str:
    """``key``'s path in the JSON below ``where`` ("" at the top)."""
    if not where:
        return str(key)
    return f"{where}[{json.dumps(key) if isinstance(key, str) else key}]"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refused(key: str | int, table: Any, rule: str, where: str = "") -> ValueError:
    """``table[key]`` breaks ``rule``; an absent key is missing."""
    field = _path(where, key)
    if isinstance(table, dict) and key not in table:
        return ValueError(f"{field} is missing ({rule.removeprefix('not ')} is needed)")
    return ValueError(f"{field} is {_shown(table[key])}: {rule}")


def _number(table: Any, key: str | int, rule: str, where: str = "", positive: bool = False) -> float:
    """``table[key]``, a JSON number that is finite and >= 0 (> 0 where ``positive``)."""
    value = table.get(key) if isinstance(table, dict) else table[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refused(key, table, rule, where)
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        raise _refused(key, table, rule, where) from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise _refused(key, table, rule, where)
    return number


def _pair(table: dict[str, Any], key: str, rule: str, where: str = "") -> None:
    """``table[key]``: two numbers >= 0."""
    value = table.get(key)
    if not isinstance(value, list) or len(value) != 2:
        raise _refused(key, table, rule, where)
    for index in (0, 1):
        _number(value, index, SECONDS, _path(where, key))


def _object(
    table: dict[str, Any], key: str, rule: str, names: tuple[str, ...], where: str = "", required: bool = True
) -> dict[str, Any]:
    """``table[key]``: a JSON object of ``names`` (every one if ``required``, else some)."""
    value = table.get(key)
    if not isinstance(value, dict):
        raise _refused(key, table, f"not an object of {rule}", where)
    for name in [*value, *(names if required else ())]:
        if name not in names or name not in value:
            said = f"has {name!r}" if name not in names else f"has no {name!r}"
            raise ValueError(f"{_path(where, key)} {said}: an object of {rule}")
    return value


def _groups(table: dict[str, Any], key: str, each: Callable[[dict[str, Any], str, str], object], where: str) -> None:
    """``table[key]``: a JSON object of {"group size": ...}, each group size a whole number of 2 or more ranks, each
    value checked by ``each(groups, group, its path)``."""
    groups = table[key]
    field = _path(where, key)
    if not isinstance(groups, dict):
        raise _refused(key, table, 'not an object of {"group size": ...}', where)
    for group in groups:
        if not isinstance(group, str) or not re.fullmatch(r"[1-9][0-9]*", group) or int(group) < 2:
            raise ValueError(
                f"{field} has the group size {group!r}: a group size is a whole number of 2 or more "
                'ranks, written as "2" (a ring over one rank has no rounds to price)'
            )
        each(groups, group, field)


def _price(groups: dict[str, Any], group: str, where: str) -> None:
    """A collective's price over a group: [latency, per_byte] (a Link), or [[bytes, seconds], ...] (a Curve) at
    positive sizes, ascending, each measured once (the planner divides by the gap between two)."""
    value, field = groups[group], _path(where, group)
    if not (isinstance(value, list) and value and all(isinstance(p, list) for p in value)):
        if isinstance(value, list) and len(value) == 2 and not any(isinstance(v, list) for v in value):
            _pair(groups, group, PAIR, where)
            return
        raise _refused(group, groups, f"{PAIR} or a list of [bytes, seconds] points", where)
    sizes = []
    for index, point in enumerate(value):
        if len(point) != 2:
            raise _refused(index, value, "not a [bytes, seconds] point", field)
        sizes.append(_number(point, 0, BYTES, _path(field, index), positive=True))
        _number(point, 1, SECONDS, _path(field, index))
    for smaller, larger in zip(sizes, sizes[1:], strict=False):
        if larger == smaller:
            raise ValueError(
                f"{field} is measured twice at {smaller:.0f} bytes: a curve has each size measured "
                "once (the planner divides by the gap between two)"
            )
        if larger < smaller:
            raise ValueError(
                f"{field} has {larger:.0f} bytes after {smaller:.0f}: a curve's sizes ascend, as "
                "calibration writes them"
            )
