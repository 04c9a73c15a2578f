"""First-order predictor of the dual-path responses from operator traces and the error's allocation.

Linearizing one attention layer around its clean cache, an error ``e_jd`` on channel d of cached token j moves
head h's output contribution for query i by

    RoPE:     P_hij (v'_hj - o'_hi) * scale * q_pe_hid
    content:  P_hij (v'_hj - o'_hi) * scale * q_lat_hid  +  P_hij W'_h[:, d]

with ``P`` the attention probabilities, ``v'_hj = W'_h c_j`` head h's value mapped through ``o_proj``
(``W'_h = o_proj_h W_UV_h`` [D, Dc]) and ``o'_hi = sum_j P_hij v'_hj``. Treating the error elements as
uncorrelated (a diagonal error covariance) and the heads as incoherent, the expected output error energy is

    E||dO||^2 = sum_{j, d} e_jd^2 K_jd,      K_jd = sum_{h, i} ||dO_hi / de_jd||^2          (the operator trace)

so a layer's predicted response is ``sum e^2 K / (||O||^2 * cache NMSE)``. Three predictors, as in the paper's
Table 5:

* ``cache_error_only``: the cache error alone cannot tell the paths apart at matched NMSE: response 1, ratio 1;
* ``operator_only``: the trace under an error spread evenly over tokens and channels, ``mean(K) * ||x||^2 / ...``;
* ``operator_allocation``: the trace weighted by the actual error's per-token, per-channel energy ``e_jd^2``.

:func:`validate_predictor` compares predictions with measured responses (Spearman correlation and median absolute
log error over all points, and the mean absolute error of the per-layer log RoPE/content ratio). One global log
offset (the part of the gain the diagonal, per-head approximation misses on average) is fitted on the layers
with even index and evaluated on the odd ones (held out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from quantmla.analysis.error_model import _path_error, _scale_to
from quantmla.calibrate.blocks import iter_attention_inputs, resolve_device
from quantmla.calibrate.objectives import LayerInputs, attention_output, layer_inputs, sample_queries
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import MLALayerWeights, extract_layer_weights
from quantmla.quant.formats import CacheFormat, get_format

PREDICTORS = ("cache_error_only", "operator_only", "operator_allocation")


@torch.no_grad()
def operator_traces(
    x: LayerInputs, w: MLALayerWeights, spec: MLASpec, reads: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``K_content`` [B, S, Dc] and ``K_rope`` [B, S, Dr]: output-error energy per unit error on each cached
    element, summed over heads and queries (see the module docstring). ``reads`` [Tq, S] (e.g. ``x.quant_mask``):
    count only the (query, key) pairs where the query reads the erroneous copy (the cache policy reads sink and
    local tokens exactly); None = every causal pair."""
    scale = spec.softmax_scale
    logits = torch.einsum("bhic,bjc->bhij", x.q_lat, x.c) + torch.einsum("bhir,bjr->bhij", x.q_pe, x.k_pe)
    logits = (logits * scale).masked_fill(~x.mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)  # [B, H, Tq, S]
    p = torch.nan_to_num(p)
    heads, dv = spec.num_heads, spec.v_head_dim
    o_w = w.o_proj.float().view(w.o_proj.shape[0], heads, dv)  # [D, H, Dv]
    w_out = torch.einsum("dhv,hvc->hdc", o_w, w.w_uv.float())  # W'_h [H, D, Dc]
    v = torch.einsum("bjc,hdc->bhjd", x.c, w_out)  # v'_hj [B, H, S, D]
    o = torch.einsum("bhij,bhjd->bhid", p, v)  # o'_hi [B, H, Tq, D]
    vv = (v * v).sum(-1)  # [B, H, S]
    oo = (o * o).sum(-1)  # [B, H, Tq]
    dist = vv[:, :, None, :] - 2 * torch.einsum("bhid,bhjd->bhij", o, v) + oo[..., None]  # ||v'_j - o'_i||^2
    p2 = p * p
    if reads is not None:
        p2 = p2 * reads.to(p2.dtype)  # every term below is a sum over (i, j) weighted by P_ij^2
    p2d = p2 * dist.clamp_min(0)
    k_rope = scale**2 * torch.einsum("bhij,bhir->bjr", p2d, x.q_pe.pow(2))
    term1 = scale**2 * torch.einsum("bhij,bhic->bjc", p2d, x.q_lat.pow(2))
    wn2 = w_out.pow(2).sum(1)  # ||W'_h[:, c]||^2 [H, Dc]
    term2 = torch.einsum("bhij,hc->bjc", p2, wn2)
    a = torch.einsum("bhjd,hdc->bhjc", v, w_out)  # v'_hj . W'_h[:, c]
    b = torch.einsum("bhid,hdc->bhic", o, w_out)  # o'_hi . W'_h[:, c]
    c1 = torch.einsum("bhij,bhic->bhjc", p2, x.q_lat)
    term3 = 2 * scale * ((c1 * a).sum(1) - torch.einsum("bhij,bhic->bjc", p2, x.q_lat * b))
    return term1 + term2 + term3, k_rope


@dataclass
class PredictedPoint:
    layer: int
    cache_nmse: float
    path: str
    measured: float  # measured response (output NMSE / cache NMSE)
    predicted: dict = field(default_factory=dict)  # predictor -> predicted response


@torch.no_grad()
def layer_points(
    attn: nn.Module,
    spec: MLASpec,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fmt: CacheFormat,
    levels: Sequence[float],
    batch_size: int = 2,
    query_tokens: int = 128,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> list[PredictedPoint]:
    """Measured and predicted responses of one attention module at each level and path."""
    device = torch.device(device)
    w = extract_layer_weights(attn).to(device=device, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    cos, sin = cos.to(device), sin.to(device)
    keys = [(lv, p) for lv in levels for p in ("content", "rope")]
    meas = dict.fromkeys(keys, 0.0)
    pred = {k: dict.fromkeys(PREDICTORS[1:], 0.0) for k in keys}
    ref_energy = 0.0
    for i in range(0, hidden.shape[0], batch_size):
        x = layer_inputs(
            w, spec, hidden[i : i + batch_size].to(device), cos, sin, sample_queries(hidden.shape[1], query_tokens, gen)
        )
        ref = attention_output(x, w, spec, x.c, x.k_pe)
        ref_energy += float(ref.pow(2).sum())
        k_c, k_r = operator_traces(x, w, spec)
        for lv, path in keys:
            clean, kk = (x.c, k_c) if path == "content" else (x.k_pe, k_r)
            e = _scale_to(_path_error(clean, fmt.content if path == "content" else fmt.rope), clean, lv)
            c = x.c + e if path == "content" else x.c
            k = x.k_pe + e if path == "rope" else x.k_pe
            meas[(lv, path)] += float((attention_output(x, w, spec, c, k) - ref).pow(2).sum())
            pred[(lv, path)]["operator_allocation"] += float((e.pow(2) * kk).sum())
            pred[(lv, path)]["operator_only"] += float(kk.mean() * e.pow(2).sum())
    out = []
    for lv, path in keys:
        p = {name: v / ref_energy / lv for name, v in pred[(lv, path)].items()}
        p["cache_error_only"] = 1.0
        out.append(PredictedPoint(attn.layer_idx, lv, path, meas[(lv, path)] / ref_energy / lv, p))
    return out


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties; nan when a side is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(ra)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")


@dataclass
class PredictorReport:
    points: list[PredictedPoint]
    metrics: dict

    def to_dict(self) -> dict:
        return {"points": [asdict(p) for p in self.points], "metrics": self.metrics}


def validate_predictor(points: Sequence[PredictedPoint]) -> dict:
    """Per predictor: Spearman and median |log error| of the responses on held-out layers (odd index; a global
    log offset fitted on the even ones), and the MAE of the per-layer log RoPE/content ratio.

    The pooled Spearman mixes both paths, so a predictor that only separates the paths (when one path's responses
    are all far above the other's) already scores high; ``spearman_within_path`` ranks the held-out layers of each
    path separately (the layer-wise amplification proper)."""
    layers = sorted({p.layer for p in points})
    held = {lay for k, lay in enumerate(layers) if k % 2 == 1} or set(layers)
    fit = [p for p in points if p.layer not in held] or list(points)
    test = [p for p in points if p.layer in held]
    out = {}
    for name in PREDICTORS:
        logs = [math.log(p.measured) - math.log(p.predicted[name]) for p in fit if p.predicted[name] > 0]
        off = sum(logs) / len(logs) if logs else 0.0
        pr = [p.predicted[name] * math.exp(off) for p in test]
        me = [p.measured for p in test]
        errs = sorted(abs(math.log(a) - math.log(b)) for a, b in zip(pr, me, strict=True) if a > 0 and b > 0)
        ratio_err = []
        for lay in sorted(held):
            for lv in sorted({p.cache_nmse for p in test}):
                sel = {p.path: p for p in test if p.layer == lay and p.cache_nmse == lv}
                if {"content", "rope"} <= set(sel):
                    m = math.log(sel["rope"].measured / sel["content"].measured)
                    q = math.log(sel["rope"].predicted[name] / sel["content"].predicted[name])
                    ratio_err.append(abs(m - q))
        within = {}
        for path in ("content", "rope"):
            idx = [k for k, p in enumerate(test) if p.path == path]
            within[path] = spearman([pr[k] for k in idx], [me[k] for k in idx]) if len(idx) > 2 else float("nan")
        out[name] = {
            "spearman": spearman(pr, me) if len(pr) > 2 else float("nan"),
            "spearman_within_path": within,
            "median_abs_log_error": errs[len(errs) // 2] if errs else float("nan"),
            "log_ratio_mae": sum(ratio_err) / len(ratio_err) if ratio_err else float("nan"),
            "log_offset": off,
            "held_out_points": len(test),
        }
    return out


def predict_model(
    model: nn.Module,
    tokens: torch.Tensor,
    fmt: CacheFormat | str = "c4r4",
    levels: Sequence[float] = (1e-2, 1e-3),
    batch_size: int = 2,
    query_tokens: int = 128,
    device: str = "auto",
    progress: bool = True,
    seed: int = 0,
) -> PredictorReport:
    """Measured vs predicted responses for every attention layer of ``model`` on ``tokens`` [N, S], validated."""
    fmt = get_format(fmt)
    spec = MLASpec.from_config(model.config)
    dev = resolve_device(device)
    points: list[PredictedPoint] = []
    model.eval()
    for attn, x, cos, sin in iter_attention_inputs(model, torch.as_tensor(tokens).long(), batch_size, dev, progress):
        points.extend(
            layer_points(attn, spec, x, cos, sin, fmt, levels, batch_size, query_tokens, dev, seed + attn.layer_idx)
        )
    return PredictorReport(points, validate_predictor(points))
