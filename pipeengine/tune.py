"""``from pipeengine.tune import tune`` and ``python -m pipeengine.tune``: the planner, pipeengine.planner.tune."""

from __future__ import annotations

import sys

from pipeengine.planner.tune import Candidate, TuneResult, choose, main, progress_printer, tune

__all__ = ["Candidate", "TuneResult", "choose", "main", "progress_printer", "tune"]

if __name__ == "__main__":
    sys.exit(main())
