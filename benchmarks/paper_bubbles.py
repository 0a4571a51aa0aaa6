"""Simulated ZB-H1 and 1F1B bubbles on the grid of Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", Tables 3
and 9: their profiled times and message time) beside the paper's method, as tests/schedules/test_paper_bubbles.py
implements it (pure Python, no torch).

PIPEENGINE_BENCH_OUT=docs/bench python benchmarks/paper_bubbles.py     # writes paper_bubbles.md there
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.schedules.test_paper_bubbles import SETUPS, ours_bubble, paper_bubble  # noqa: E402


def table() -> str:
    """The grid as a markdown table: bubble rates in percent, the paper's method beside our simulator."""
    lines = [
        "| model | p | m | T_comm (ms) | ZB-H1, paper's method | ZB-H1, ours | 1F1B, paper's method | 1F1B, ours |",
        "|-|-|-|-|-|-|-|-|",
    ]
    for model, (p, counts, f, b, w, c) in SETUPS.items():
        for m in counts:
            rates = [
                bubble(name, p, m, f, b, w, c) for name in ("zb-h1", "1f1b") for bubble in (paper_bubble, ours_bubble)
            ]
            lines.append(f"| {model} | {p} | {m} | {c} | " + " | ".join(f"{100 * r:.2f}%" for r in rates) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    made = table()
    print(made, end="")
    out = Path(os.environ.get("PIPEENGINE_BENCH_OUT", "out/bench"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_bubbles.md").write_text(made)


if __name__ == "__main__":
    main()
