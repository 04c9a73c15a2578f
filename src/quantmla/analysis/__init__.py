"""quantmla.analysis: the dual-path error model (content vs RoPE output distortion at matched cache NMSE) and its
first-order predictor from operator traces and error allocation.

The names below are loaded on first use, so ``quantmla.analysis.cli`` (argument parsing) stays light.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ErrorModelReport": "quantmla.analysis.error_model",
    "LayerResponse": "quantmla.analysis.error_model",
    "analyze_model": "quantmla.analysis.error_model",
    "plot_atlas": "quantmla.analysis.error_model",
    "PredictorReport": "quantmla.analysis.predictor",
    "predict_model": "quantmla.analysis.predictor",
    "validate_predictor": "quantmla.analysis.predictor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
