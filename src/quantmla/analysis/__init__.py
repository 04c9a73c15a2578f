"""quantmla.analysis: the dual-path error model (content vs RoPE output distortion at matched cache NMSE)."""

from quantmla.analysis.error_model import ErrorModelReport, LayerResponse, analyze_model, plot_atlas

__all__ = ["ErrorModelReport", "LayerResponse", "analyze_model", "plot_atlas"]
