"""Dual-path error model: how much attention-output distortion a unit of cache error causes on each MLA path.

For every attention layer we take the calibration text's real cached tensors -- the latent ``c`` [B, S, Dc] and
the rotated RoPE key ``k_pe`` [B, S, Dr] -- and perturb *one path at a time* with an error whose energy is set to
a target cache NMSE (``||e||^2 / ||x||^2``, e.g. 1e-2 and 1e-3), keeping the *geometry* of the real quantization
error (``e`` is the format's ``QDQ(x) - x``, rescaled). The layer's attention output (``o_proj`` without bias,
fp32, causal, sampled query positions) is recomputed and compared with the clean one:

    response_path = output NMSE / cache NMSE         (a gain: > 1 means the path amplifies its error)
    ratio         = response_rope / response_content

Model-level numbers average the per-layer responses (the ratio of the averages, like the paper's Table 4).
Optional equal-energy interventions (the paper's Table 6) replace the error, at the same energy, by a sign-
randomized copy, by a copy with whole tokens permuted, or by an isotropic Gaussian direction, and report the
response relative to the original error's: they separate operator sensitivity from error allocation.

Results: :class:`ErrorModelReport` (``to_dict`` / ``save_json``) and :func:`plot_atlas` (a heatmap PNG like the
paper's Figure 6; needs matplotlib, imported only there).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantmla.calibrate.blocks import iter_attention_inputs, resolve_device
from quantmla.calibrate.objectives import attention_output, layer_inputs, sample_queries
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import extract_layer_weights
from quantmla.quant.formats import CacheFormat, get_format
from quantmla.quant.quantize import fake_quantize
from quantmla.quant.spec import QuantSpec

INTERVENTIONS = ("sign", "token_permutation", "isotropic")
_DEFAULT_SPEC = QuantSpec(bits=4, group_size=64)


@dataclass
class LayerResponse:
    layer: int
    cache_nmse: float
    content_out_nmse: float
    rope_out_nmse: float
    content_response: float
    rope_response: float
    ratio: float
    interventions: dict = field(default_factory=dict)  # {"content": {"sign": gain ratio, ...}, "rope": {...}}


@dataclass
class ErrorModelReport:
    model_type: str
    format: str
    levels: list[float]
    num_sequences: int
    seq_len: int
    layers: list[LayerResponse] = field(default_factory=list)

    def at(self, level: float) -> list[LayerResponse]:
        return [r for r in self.layers if math.isclose(r.cache_nmse, level, rel_tol=1e-9)]

    def model_level(self) -> dict[str, dict[str, float]]:
        """Per level: mean content response, mean RoPE response, their ratio, and the median per-layer ratio."""
        out = {}
        for lv in self.levels:
            rows = self.at(lv)
            if not rows:
                continue
            c = sum(r.content_response for r in rows) / len(rows)
            r_ = sum(r.rope_response for r in rows) / len(rows)
            ratios = sorted(r.ratio for r in rows)
            out[f"{lv:g}"] = {
                "content_response": c,
                "rope_response": r_,
                "ratio": r_ / c if c > 0 else float("inf"),
                "median_layer_ratio": ratios[len(ratios) // 2],
            }
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_level"] = self.model_level()
        return d

    def save_json(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return p


def _path_error(x: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """The quantization error ``QDQ(x) - x`` of a path (fp32); a 4-bit/64-group quantizer when ``spec`` is None."""
    spec = spec or _DEFAULT_SPEC
    if x.shape[-1] % spec.group_size:
        spec = QuantSpec(bits=spec.bits, group_size=x.shape[-1], symmetric=spec.symmetric)
    return fake_quantize(x, spec).float() - x.float()


def _scale_to(e: torch.Tensor, x: torch.Tensor, nmse: float) -> torch.Tensor:
    """``e`` rescaled so that ``||e||^2 / ||x||^2 == nmse``."""
    en = e.pow(2).sum()
    if en <= 0:
        raise ValueError("the quantization error is exactly zero; cannot rescale it to a target NMSE")
    return e * torch.sqrt(nmse * x.pow(2).sum() / en)


def intervene(e: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """An equal-energy variant of the error ``e`` [B, S, D]: random signs per element, tokens permuted (per
    sequence), or an isotropic Gaussian direction; rescaled to ``e``'s energy."""
    if kind == "sign":
        out = e * (torch.randint(0, 2, e.shape, generator=gen).to(e) * 2 - 1)
    elif kind == "token_permutation":
        perm = torch.randperm(e.shape[1], generator=gen)
        out = e[:, perm]
    elif kind == "isotropic":
        out = torch.randn(e.shape, generator=gen).to(e)
    else:
        raise ValueError(f"unknown intervention {kind!r}; choose one of {INTERVENTIONS}")
    return out * torch.sqrt(e.pow(2).sum() / out.pow(2).sum().clamp_min(1e-30))


def _out_err(x, w, spec: MLASpec, ref: torch.Tensor, path: str, e: torch.Tensor) -> float:
    """Squared output error with the error ``e`` added to one path's cached tensor."""
    c = x.c + e if path == "content" else x.c
    k = x.k_pe + e if path == "rope" else x.k_pe
    return float((attention_output(x, w, spec, c, k) - ref).pow(2).sum())


@torch.no_grad()
def layer_response(
    attn: nn.Module,
    spec: MLASpec,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fmt: CacheFormat,
    levels: Sequence[float],
    batch_size: int = 4,
    query_tokens: int = 256,
    interventions: Sequence[str] = (),
    repeats: int = 4,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> list[LayerResponse]:
    """Responses of one attention module (inputs ``hidden`` [N, S, D]) at every cache-NMSE level."""
    device = torch.device(device)
    w = extract_layer_weights(attn).to(device=device, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    cos, sin = cos.to(device), sin.to(device)
    acc = {lv: {"ref": 0.0, "content": 0.0, "rope": 0.0} for lv in levels}
    iv = {lv: {p: {k: 0.0 for k in interventions} for p in ("content", "rope")} for lv in levels}
    for i in range(0, hidden.shape[0], batch_size):
        x = layer_inputs(
            w, spec, hidden[i : i + batch_size].to(device), cos, sin, sample_queries(hidden.shape[1], query_tokens, gen)
        )
        ref = attention_output(x, w, spec, x.c, x.k_pe)
        err = {"content": _path_error(x.c, fmt.content), "rope": _path_error(x.k_pe, fmt.rope)}
        for lv in levels:
            acc[lv]["ref"] += float(ref.pow(2).sum())
            for path, clean in (("content", x.c), ("rope", x.k_pe)):
                e = _scale_to(err[path], clean, lv)

                acc[lv][path] += _out_err(x, w, spec, ref, path, e)
                for kind in interventions:
                    for _ in range(repeats):
                        iv[lv][path][kind] += _out_err(x, w, spec, ref, path, intervene(e, kind, gen)) / repeats
    out = []
    for lv in levels:
        a = acc[lv]
        c_nmse, r_nmse = a["content"] / a["ref"], a["rope"] / a["ref"]
        c_resp, r_resp = c_nmse / lv, r_nmse / lv
        ivr = (
            {p: {k: iv[lv][p][k] / max(a[p], 1e-30) for k in interventions} for p in ("content", "rope")}
            if interventions
            else {}
        )
        out.append(LayerResponse(attn.layer_idx, lv, c_nmse, r_nmse, c_resp, r_resp, r_resp / max(c_resp, 1e-30), ivr))
    return out


def analyze_model(
    model: nn.Module,
    tokens: torch.Tensor,
    fmt: CacheFormat | str = "c4r4",
    levels: Sequence[float] = (1e-2, 1e-3),
    batch_size: int = 4,
    query_tokens: int = 256,
    interventions: Sequence[str] = (),
    repeats: int = 4,
    device: str = "auto",
    progress: bool = True,
    seed: int = 0,
) -> ErrorModelReport:
    """The dual-path error model of every MLA attention layer of ``model`` on ``tokens`` [N, S].

    ``fmt`` supplies the error geometry (its content and RoPE quantizers; a path stored in BF16 falls back to a
    4-bit quantizer). The model is not modified.
    """
    fmt = get_format(fmt)
    spec = MLASpec.from_config(model.config)
    dev = resolve_device(device)
    for kind in interventions:
        if kind not in INTERVENTIONS:
            raise ValueError(f"unknown intervention {kind!r}; choose from {INTERVENTIONS}")
    if any(not 0 < lv < 1 for lv in levels):
        raise ValueError(f"cache NMSE levels must be in (0, 1), got {list(levels)}")
    tokens = torch.as_tensor(tokens).long()
    report = ErrorModelReport(spec.model_type, fmt.name, [float(lv) for lv in levels], tokens.shape[0], tokens.shape[1])
    model.eval()
    for attn, x, cos, sin in iter_attention_inputs(model, tokens, batch_size, dev, progress):
        report.layers.extend(
            layer_response(
                attn,
                spec,
                x,
                cos,
                sin,
                fmt,
                report.levels,
                batch_size,
                query_tokens,
                interventions,
                repeats,
                dev,
                seed + attn.layer_idx,
            )
        )
    return report


def plot_atlas(report: ErrorModelReport, path: str | Path, level: float | None = None) -> Path | None:
    """Heatmap PNG (rows: content response, RoPE response, RoPE/content ratio; columns: layers; log colour scale).
    Returns None (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        return None
    level = report.levels[0] if level is None else level
    rows = report.at(level)
    if not rows:
        raise ValueError(f"no results at cache NMSE {level}")
    import numpy as np

    data = np.array([[r.content_response for r in rows], [r.rope_response for r in rows], [r.ratio for r in rows]])
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.35 * len(rows) + 2), 3.6), constrained_layout=True)
    resp = data[:2].clip(min=1e-6)
    im0 = axes[0].imshow(resp, aspect="auto", cmap="viridis", norm=LogNorm(vmin=resp.min(), vmax=resp.max()))
    axes[0].set_yticks([0, 1], ["C", "R"])
    axes[0].set_title(f"{report.model_type} {report.format}: output NMSE / cache NMSE at cache NMSE {level:g}")
    fig.colorbar(im0, ax=axes[0])
    ratio = data[2:].clip(min=1e-6)
    lim = max(ratio.max(), 1 / ratio.min())
    im1 = axes[1].imshow(ratio, aspect="auto", cmap="RdBu_r", norm=LogNorm(vmin=1 / lim, vmax=lim))
    axes[1].set_yticks([0], ["R/C"])
    axes[1].set_xlabel("attention layer")
    fig.colorbar(im1, ax=axes[1])
    for ax in axes:
        ax.set_xticks(range(len(rows)), [str(r.layer) for r in rows], fontsize=7)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
