"""``from pipeengine.tune import tune`` and ``python -m pipeengine.tune``: the planner (pipeengine.planner: measure,
costmodel, calibration, search, result, cli)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pipeengine.engine import PipelineEngine
from pipeengine.planner import cli
from pipeengine.planner.calibration import Prices
from pipeengine.planner.candidates import layouts
from pipeengine.planner.cli import progress_printer
from pipeengine.planner.result import Candidate, TuneResult
from pipeengine.planner.search import choose, tune

__all__ = ["Candidate", "Prices", "TuneResult", "choose", "layouts", "main", "progress_printer", "tune"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeengine.tune``: plan a model, or (--calibrate) measure this machine's prices with the engine."""
    return cli.main(argv, engine=PipelineEngine)


if __name__ == "__main__":
    sys.exit(main())
