"""Small shims over transformers versions (5.17 on our GPU machine, 5.24+ elsewhere).

transformers 5.24 renamed the cache argument of forward/generate from ``past_key_values`` to ``cache``
(the old name still works there, with a deprecation warning).
"""

from __future__ import annotations

import transformers
from packaging.version import Version


def cache_kwarg() -> str:
    """Name of the cache keyword argument of ``model(...)`` / ``model.generate(...)``."""
    return "cache" if Version(transformers.__version__.split("+")[0]) >= Version("5.24.0.dev0") else "past_key_values"


def with_cache(cache) -> dict:
    """``{cache_kwarg(): cache}``, to splat into a forward or generate call."""
    return {cache_kwarg(): cache}


def output_cache(outputs):
    """The cache object returned by a forward call, under either name."""
    for name in ("cache", "past_key_values"):
        c = getattr(outputs, name, None)
        if c is not None:
            return c
    return None
