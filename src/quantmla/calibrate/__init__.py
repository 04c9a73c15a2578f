"""quantmla.calibrate: QuantMLA's fold-exact transform families, function-aligned learning, baselines, fusion.

Entry points: :func:`calibrate_model` (learn or set the transforms layer by layer and fold them in place),
:func:`save_fused` (write the fused checkpoint with its ``quantmla.json``), :class:`CalibrationConfig`.
Importing this package does not import transformers model code or touch CUDA.
"""

from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.fuse import (
    fold_content,
    fold_rope,
    fold_transforms,
    load_quant_config,
    make_quant_config,
    save_fused,
)
from quantmla.calibrate.trainer import CalibrationReport, calibrate_model
from quantmla.calibrate.transforms import ContentTransform, RopeTransform

__all__ = [
    "CalibrationConfig",
    "CalibrationReport",
    "ContentTransform",
    "RopeTransform",
    "calibrate_model",
    "fold_content",
    "fold_rope",
    "fold_transforms",
    "load_quant_config",
    "make_quant_config",
    "save_fused",
]
