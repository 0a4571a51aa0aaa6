"""``from pipeengine.tune import tune`` and ``python -m pipeengine.tune``: the planner (pipeengine.planner: measure,
costmodel, calibration, search, result, cli)."""

from __future__ import annotations

import sys

from pipeengine.planner.calibration import Prices, calibrate, measure_machine
from pipeengine.planner.cli import main, progress_printer
from pipeengine.planner.result import Candidate, TuneResult
from pipeengine.planner.search import choose, layouts, tune

__all__ = ["Candidate", "Prices", "TuneResult", "calibrate", "choose", "layouts", "main", "measure_machine",
           "progress_printer", "tune"]

if __name__ == "__main__":
    sys.exit(main())
