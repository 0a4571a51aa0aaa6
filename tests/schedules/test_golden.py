"""Golden grids, checked verbatim. Regenerate one (after reading the diff!) with e.g.

python -m schedules show 1f1b -p 4 -m 8 > tests/golden/1f1b_p4_m8.txt
"""

from pathlib import Path

import pytest

from schedules import build_schedule, compile_schedule

GOLDEN = Path(__file__).parent.parent / "golden"


@pytest.mark.parametrize(
    "file, name, p, m, v, lowered",
    [
        ("1f1b_p4_m8.txt", "1f1b", 4, 8, 1, True),
        ("1f1b_p4_m8_compute.txt", "1f1b", 4, 8, 1, False),
        ("gpipe_p3_m4.txt", "gpipe", 3, 4, 1, True),
        ("interleaved_p2_m4_v2.txt", "interleaved", 2, 4, 2, True),
    ],
)
def test_grid_is_verbatim(file: str, name: str, p: int, m: int, v: int, lowered: bool) -> None:
    build = build_schedule if lowered else compile_schedule
    assert str(build(name, p, m, v)) + "\n" == (GOLDEN / file).read_text()


def test_build_schedule_docstring_shows_the_real_grid() -> None:
    import inspect
    import textwrap

    shown = textwrap.dedent((inspect.getdoc(build_schedule) or "").split("::\n\n", 1)[1]).strip()
    assert shown == str(build_schedule("1f1b", 2, 2))
