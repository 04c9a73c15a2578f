"""Progress when stderr is not a terminal: a line at most every interval, for the outer loop, with the time left."""

from __future__ import annotations

import re

from quantmla.progress import LineProgress, fmt_seconds, progress


def test_fmt_seconds():
    assert [fmt_seconds(s) for s in (0.4, 42, 65, 3600 + 120)] == ["0 s", "42 s", "1 min 05 s", "1 h 02 min"]


def test_line_progress_reports_the_outer_loop_with_time_left(capsys):
    seen = []
    for i in LineProgress(range(3), "layers", interval=0.0):
        for j in LineProgress(range(2), f"content L{i}", interval=0.0):
            seen.append((i, j))
    assert seen == [(i, j) for i in range(3) for j in range(2)]  # iterates exactly like the iterable
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(ln.startswith("   .. layers ") for ln in lines)
    assert "(content L0 1/2)" in lines[0] and re.search(r"layers 3/3: \d+ s elapsed, about 0 s left$", lines[-1])


def test_line_progress_is_quiet_within_the_interval(capsys):
    assert list(LineProgress(range(50), "steps", interval=3600.0)) == list(range(50))
    assert capsys.readouterr().err == ""


def test_progress_is_compact_when_stderr_is_not_a_terminal(capsys):
    assert isinstance(progress(range(2), "x"), LineProgress)  # pytest captures stderr: not a terminal
