"""quantmla.analysis: the dual-path error model (content vs RoPE output distortion at matched cache NMSE) and its
first-order predictor from operator traces and error allocation."""

from quantmla.analysis.error_model import ErrorModelReport, LayerResponse, analyze_model, plot_atlas
from quantmla.analysis.predictor import PredictorReport, predict_model, validate_predictor

__all__ = [
    "ErrorModelReport",
    "LayerResponse",
    "PredictorReport",
    "analyze_model",
    "plot_atlas",
    "predict_model",
    "validate_predictor",
]
