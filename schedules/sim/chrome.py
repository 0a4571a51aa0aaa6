"""Chrome trace export: JSON for chrome://tracing and Perfetto, one process per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from schedules.ir.instructions import Post

if TYPE_CHECKING:  # typing only: timeline.py imports this module lazily, so no import runs back
    from schedules.sim.timeline import Timeline

__all__ = ["chrome_trace_events", "write_chrome_trace"]


def chrome_trace_events(timeline: Timeline) -> list[dict[str, object]]:
    """Trace events: per rank a process ("rank r") with a compute thread and a communication thread.

    Measured timelines (seconds) become microseconds; simulated ones take 1 cost unit = 1 ms.
    """
    scale = 1e6 if timeline.unit == "s" else 1e3
    origin = timeline.start
    events: list[dict[str, object]] = []
    for rank in range(timeline.num_ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "communication"}})
    for span in timeline.spans:
        compute_thread = span.is_compute or span.wait  # the host is busy (or blocked) in both
        name = f"wait {span.action}" if span.wait else str(span.action)
        category = "wait" if span.wait else ("compute" if span.is_compute else "post")
        if isinstance(span.action, Post):
            category = "post"
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": category,
                "pid": span.rank,
                "tid": 0 if compute_thread else 1,
                "ts": (span.start - origin) * scale,
                "dur": span.duration * scale,
            }
        )
    return events


def write_chrome_trace(timeline: Timeline, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # its missing folders made (out/step.json)
    with open(path, "w") as out:
        json.dump({"traceEvents": chrome_trace_events(timeline), "displayTimeUnit": "ms"}, out)
