"""Load a script of ``benchmarks/`` as a module (the benchmarks are scripts, not a package) for the tests of it."""

from __future__ import annotations

import importlib.util
import os

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` executed as module ``name`` (its own ``sys.path`` insertion finds its siblings)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
