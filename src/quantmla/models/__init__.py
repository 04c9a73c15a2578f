"""quantmla.models: the ``quantmla_mla`` model class and the GQA -> MLA conversion (``quantmla convert``).

``import quantmla.models.mla_model`` registers ``quantmla_mla`` with transformers' Auto classes; the names below
are loaded on first use, so importing a light submodule (``quantmla.models.cli``) does not import transformers.
"""

from __future__ import annotations

import importlib

_LAZY = {name: "quantmla.models.mla_model" for name in ("MODEL_TYPE", "QuantMLAConfig", "QuantMLAForCausalLM",
                                                        "register")}  # fmt: skip

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
