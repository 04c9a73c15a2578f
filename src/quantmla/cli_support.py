"""What every ``quantmla`` command shares: the error that means "fix your arguments" and output-path checks that run
before the expensive work (the folders themselves are written by :mod:`quantmla.artifacts`).

Exit codes (set by :func:`quantmla.cli.main`): 2 for a :class:`UsageError` (bad arguments, caught before the work
starts), 1 for a failure while the job runs, 130 on Ctrl-C. Light on purpose: no torch here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


class UsageError(Exception):
    """A bad argument: the message names it and says how to fix it (exit code 2)."""


@contextlib.contextmanager
def usage_errors(prefix: str = "") -> Iterator[None]:
    """Turn the library's argument checks (ValueError, FileNotFoundError, ...) raised inside the block into
    :class:`UsageError`: for validation that runs before the work starts."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, LookupError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        raise UsageError(f"{prefix}{e}") from e


def _existing_ancestor(path: str) -> str:
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent or os.sep


def check_output(path: str | os.PathLike, *, flag: str = "--out", force: bool = False, kind: str = "file",
                 may_exist: bool = False) -> None:  # fmt: skip
    """Raise :class:`UsageError` now if ``path`` could not be written when the job ends.

    kind: ``"file"`` or ``"dir"``. An existing ``path`` needs ``force`` unless ``may_exist`` (a command that reuses
    what it finds, like ``convert``). The nearest existing ancestor must be a folder in which a file can be created
    (checked by creating and removing one: permission bits do not tell for root or read-only mounts).
    """
    p = os.path.abspath(os.fspath(path))
    if os.path.exists(p):
        if kind == "file" and os.path.isdir(p):
            raise UsageError(f"{flag} {path} is a folder; give a file path")
        if kind == "dir" and not os.path.isdir(p):
            raise UsageError(f"{flag} {path} is a file; give a folder path")
        if not (force or may_exist):
            raise UsageError(f"{flag} {path} exists; pass --force to overwrite it, or choose another path")
    parent = _existing_ancestor(p)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder; choose a path outside it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".quantmla-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {parent} ({e.strerror}); choose a writable place") from None
