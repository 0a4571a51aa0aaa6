"""python -m tests.composition --pairs: how many pairs of feature levels the matrix covers, and its configurations."""

from __future__ import annotations

import argparse
import os
import sys

from tests.composition import FACTORS, matrix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", action="store_true", help="print the pairs covered and every configuration")
    args = parser.parse_args()
    found = matrix()
    print(f"pairs covered: {found.covered} of {found.possible}")
    if not args.pairs:
        return
    print(f"{len(found.running)} configurations run against one process, {len(found.refused)} are refused")
    print(f"factors: {', '.join(f'{name} ({len(levels)})' for name, levels in FACTORS.items())}")
    for index, config in enumerate(found.running):
        print(f"{index:3d}  {'processes' if config.processes else 'threads  '} {config.world} ranks  {config}")
    for config, message in found.refused:
        print(f"refused  {config}  -> {message!r}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # piped into head: what it read was printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
