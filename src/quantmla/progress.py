"""Progress for long loops: tqdm bars on a terminal, a compact line with the time left otherwise.

When stderr is not a terminal (CI logs, ``2> log``, a pipe), tqdm would still write every refresh (hundreds of
kilobytes for the main job); :class:`LineProgress` writes one line at most every ``interval`` seconds, for the
outermost loop running (with the innermost one's name), e.g.
``   .. layers 12/30 (content L11 10/24): 48 s elapsed, about 1 min 12 s left``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

INTERVAL_S = 30.0


def fmt_seconds(s: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class LineProgress:
    """Iterate ``it`` and report on stderr at most every ``interval`` seconds (shared by nested loops)."""

    _active: list[LineProgress] = []
    _last_print = 0.0

    def __init__(self, it: Iterable, desc: str, total: int | None = None, interval: float = INTERVAL_S):
        self.it, self.desc, self.interval = it, desc, interval
        self.total = total if total is not None else (len(it) if hasattr(it, "__len__") else None)
        self.n, self.postfix, self.t0 = 0, "", time.monotonic()

    def set_postfix(self, **kw) -> None:  # tqdm's signature, so callers need not care which they got
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def status(self, now: float) -> str:
        elapsed = now - self.t0
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        line = f"{self.desc} {done}"
        inner = LineProgress._active[-1]
        if inner is not self:
            line += f" ({inner.desc} {inner.n}/{inner.total or '?'})"
        line += f": {fmt_seconds(elapsed)} elapsed"
        if self.total and self.n:
            line += f", about {fmt_seconds(elapsed / self.n * (self.total - self.n))} left"
        return line

    def _tick(self) -> None:
        now = time.monotonic()
        if now - LineProgress._last_print >= self.interval:
            LineProgress._last_print = now
            print(f"   .. {LineProgress._active[0].status(now)}", file=sys.stderr, flush=True)

    def __iter__(self) -> Iterator:
        if not LineProgress._active:
            LineProgress._last_print = time.monotonic()
        LineProgress._active.append(self)
        self.t0 = time.monotonic()
        try:
            for x in self.it:
                yield x
                self.n += 1
                self._tick()
        finally:
            LineProgress._active.remove(self)


def progress(it: Iterable, desc: str, total: int | None = None, *, leave: bool = False):
    """tqdm on a terminal, :class:`LineProgress` otherwise (also when tqdm is missing)."""
    if stderr_is_terminal():
        try:
            from tqdm.auto import tqdm

            return tqdm(it, desc=desc, total=total, leave=leave)
        except ImportError:  # pragma: no cover
            pass
    return LineProgress(it, desc, total)
