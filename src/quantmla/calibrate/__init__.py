"""quantmla.calibrate: QuantMLA's fold-exact transform families, function-aligned learning, baselines, fusion.

Entry points: :func:`calibrate_model` (learn or set the transforms layer by layer and fold them in place),
:func:`save_fused` (write the fused checkpoint with its ``quantmla.json``), :class:`CalibrationConfig`.
Importing this package does not import torch, transformers model code or touch CUDA: the names below are loaded
on first use (so ``quantmla calibrate --help`` stays fast).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CalibrationConfig": "quantmla.calibrate.config",
    "fold_content": "quantmla.calibrate.fuse",
    "fold_rope": "quantmla.calibrate.fuse",
    "fold_transforms": "quantmla.calibrate.fuse",
    "load_quant_config": "quantmla.calibrate.fuse",
    "make_quant_config": "quantmla.calibrate.fuse",
    "save_fused": "quantmla.calibrate.fuse",
    "CalibrationReport": "quantmla.calibrate.trainer",
    "calibrate_model": "quantmla.calibrate.trainer",
    "ContentTransform": "quantmla.calibrate.transforms",
    "RopeTransform": "quantmla.calibrate.transforms",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
