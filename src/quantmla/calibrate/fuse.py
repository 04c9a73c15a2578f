"""Offline fusion: fold content / RoPE transforms into an MLA attention module's weights, and save the result.

Folding is exact algebra (done in float64, then cast back to the weights' dtype): after it the module computes
the same attention output in full precision, while the cache receives the transformed latent ``c T`` and the
transformed RoPE key ``k_pe z``. See :mod:`quantmla.calibrate.transforms` for the families and why they fold.

Which weights change:

=============================  ====================================================================================
content, latent norm           ``kv_a_proj_with_mqa`` latent rows (and bias) <- rotated by Q; ``kv_a_layernorm``
                               gain <- g'; ``kv_b_proj`` <- ``kv_b_proj T^-T``
content, no latent norm        ``kv_a_proj_with_mqa`` latent rows <- ``T^T W``, bias <- ``b T``; ``kv_b_proj`` as above
RoPE                           ``kv_a_proj_with_mqa`` RoPE rows (and bias) <- times z per pair; the RoPE rows of every
                               head of ``q_proj`` / ``q_b_proj`` <- times ``z / |z|^2`` per pair
=============================  ====================================================================================

:func:`save_fused` writes the fused model with ``save_pretrained`` (safetensors), ``quantmla.json`` (the cache format
and calibration settings) and any report files as one artifact folder (:mod:`quantmla.artifacts`: temp folder,
completion manifest, rename); it never replaces an existing directory unless ``force=True``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantmla.calibrate.transforms import ContentTransform, RopeTransform, complex_pair_mul
from quantmla.mla.spec import MLASpec

QUANT_CONFIG_NAME = "quantmla.json"
QUANT_CONFIG_VERSION = 1


def has_latent_norm(attn: nn.Module) -> bool:
    """True when the latent passes through an RMSNorm with a gain (``kv_a_layernorm``), False for Identity/None."""
    norm = getattr(attn, "kv_a_layernorm", None)
    return norm is not None and getattr(norm, "weight", None) is not None


def latent_norm_gain(attn: nn.Module) -> torch.Tensor | None:
    return attn.kv_a_layernorm.weight.detach() if has_latent_norm(attn) else None


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))


@torch.no_grad()
def fold_content(attn: nn.Module, t: ContentTransform) -> None:
    """Fold the content transform ``t`` into ``attn`` in place (the cache will store ``c T``).

    With a latent norm, ``t`` must be of the form ``diag(1/g) Q diag(g')`` for the module's current gain ``g``
    (build it with ``ContentTransform.identity/rotation/diagonal(..., norm_gain=g)``); anything else raises.
    """
    dc = attn.kv_lora_rank
    if t.dim != dc:
        raise ValueError(f"content transform is {t.dim}-dim but the latent is {dc}-dim")
    u, q, v = (x.detach().cpu() for x in t.factors(torch.float64))
    kv_a = attn.kv_a_proj_with_mqa
    w_lat = kv_a.weight[:dc].detach().double().cpu()  # [Dc, D]
    b_lat = None if kv_a.bias is None else kv_a.bias[:dc].detach().double().cpu()  # [Dc]
    if has_latent_norm(attn):
        g = attn.kv_a_layernorm.weight.detach().double().cpu()
        if not torch.allclose(u * g, torch.ones_like(g), rtol=1e-6, atol=1e-9):
            raise ValueError(
                "this content transform does not fold through kv_a_layernorm: with a latent norm only "
                "T = diag(g)^-1 Q diag(g') folds exactly (build it with norm_gain=the current gain)"
            )
        # pre-norm latent x' = x Q  <=>  rows W' = Q^T W; then the norm's gain becomes g' = v.
        new_w_lat = q.T @ w_lat
        new_b_lat = None if b_lat is None else b_lat @ q
        _assign(attn.kv_a_layernorm.weight, v)
    else:
        tm = u[:, None] * q * v[None, :]  # [Dc, Dc]
        new_w_lat = tm.T @ w_lat
        new_b_lat = None if b_lat is None else b_lat @ tm
    _assign(kv_a.weight[:dc], new_w_lat)
    if new_b_lat is not None:
        _assign(kv_a.bias[:dc], new_b_lat)
    # kv_b reads c = c' T^-1: W' = W T^-T = W diag(1/u) Q diag(1/v).
    w_b = attn.kv_b_proj.weight.detach().double().cpu()  # [H * (Dn + Dv), Dc]
    _assign(attn.kv_b_proj.weight, ((w_b / u[None, :]) @ q) / v[None, :])


@torch.no_grad()
def fold_content_matrix(attn: nn.Module, t: torch.Tensor) -> None:
    """Fold an arbitrary invertible ``t`` [Dc, Dc] (layouts without a latent norm only)."""
    if has_latent_norm(attn):
        raise ValueError(
            "an arbitrary invertible transform does not fold through kv_a_layernorm; use ContentTransform with "
            "norm_gain (T = diag(g)^-1 Q diag(g'))"
        )
    dc = attn.kv_lora_rank
    t = t.detach().double().cpu()
    if t.shape != (dc, dc):
        raise ValueError(f"content transform must be [{dc}, {dc}], got {tuple(t.shape)}")
    kv_a = attn.kv_a_proj_with_mqa
    _assign(kv_a.weight[:dc], t.T @ kv_a.weight[:dc].detach().double().cpu())
    if kv_a.bias is not None:
        _assign(kv_a.bias[:dc], kv_a.bias[:dc].detach().double().cpu() @ t)
    w_b = attn.kv_b_proj.weight.detach().double().cpu()
    _assign(attn.kv_b_proj.weight, torch.linalg.solve(t, w_b.T).T)  # W T^-T


def _pair_rows(w: torch.Tensor, re: torch.Tensor, im: torch.Tensor, pairing: str) -> torch.Tensor:
    """Rows [Dr, ...] of a projection whose outputs get multiplied pair-wise by ``re + i im``."""
    moved = w.movedim(0, -1)  # [..., Dr]
    return complex_pair_mul(moved, re, im, pairing).movedim(-1, 0)


@torch.no_grad()
def fold_rope(attn: nn.Module, r: RopeTransform, spec: MLASpec) -> None:
    """Fold the RoPE transform into ``attn`` in place: key RoPE rows times ``z``, query RoPE rows times
    ``z / |z|^2`` (both in the pre-RoPE pair layout ``spec.rope_pairing``)."""
    dc, dr = attn.kv_lora_rank, attn.qk_rope_head_dim
    if r.num_pairs * 2 != dr:
        raise ValueError(f"RoPE transform has {r.num_pairs} pairs but the RoPE key is {dr}-dim")
    pairing = spec.rope_pairing
    s = torch.exp(r.log_s.detach().double().cpu())
    phi = r.phi.detach().double().cpu()
    k_re, k_im = s * torch.cos(phi), s * torch.sin(phi)
    q_re, q_im = torch.cos(phi) / s, torch.sin(phi) / s
    kv_a = attn.kv_a_proj_with_mqa
    _assign(kv_a.weight[dc:], _pair_rows(kv_a.weight[dc:].detach().double().cpu(), k_re, k_im, pairing))
    if kv_a.bias is not None:
        _assign(kv_a.bias[dc:], complex_pair_mul(kv_a.bias[dc:].detach().double().cpu(), k_re, k_im, pairing))
    q_lin = attn.q_proj if getattr(attn, "q_proj", None) is not None else attn.q_b_proj
    heads, dn = attn.num_heads, attn.qk_nope_head_dim
    wq = q_lin.weight.detach().double().cpu().view(heads, dn + dr, -1)  # [H, Dn + Dr, in]
    wq = wq.clone()
    for h in range(heads):
        wq[h, dn:] = _pair_rows(wq[h, dn:], q_re, q_im, pairing)
    _assign(q_lin.weight, wq.reshape(heads * (dn + dr), -1))
    if q_lin.bias is not None:
        bq = q_lin.bias.detach().double().cpu().view(heads, dn + dr).clone()
        bq[:, dn:] = complex_pair_mul(bq[:, dn:], q_re, q_im, pairing)
        _assign(q_lin.bias, bq.reshape(-1))


def fold_transforms(
    attn: nn.Module, spec: MLASpec, content: ContentTransform | None, rope: RopeTransform | None
) -> None:
    """Fold both paths' transforms (None = identity) into one attention module."""
    if content is not None:
        fold_content(attn, content)
    if rope is not None:
        fold_rope(attn, rope, spec)


# ---- the fused checkpoint ------------------------------------------------------------------------------------


def make_quant_config(fmt: Any, calibration: Any = None, method: str = "quantmla", report: Any = None) -> dict:
    """The ``quantmla.json`` record: cache format, calibration config and a summary of the report."""
    from quantmla.quant.formats import get_format

    fmt = get_format(fmt)
    out: dict = {"quantmla_version": QUANT_CONFIG_VERSION, "method": method, "cache_format": fmt.to_dict()}
    if calibration is not None:
        out["calibration"] = calibration.to_dict() if hasattr(calibration, "to_dict") else dict(calibration)
    if report is not None:
        out["report_summary"] = report.summary() if hasattr(report, "summary") else report
    return out


def save_fused(
    model: nn.Module,
    out_dir: str | os.PathLike,
    quant_config: dict,
    force: bool = False,
    tokenizer: Any = None,
    extra_json: dict[str, Any] | None = None,
    rope_moments: dict[int, Any] | None = None,
    rope_rotations: dict[int, Any] | None = None,
    rope_rounding_meta: dict | None = None,
) -> Path:
    """Save the (fused) model as a transformers checkpoint with ``quantmla.json`` inside; return the directory.

    ``extra_json`` (file name -> JSON-serializable object, e.g. ``{"calibration_report.json": report.to_dict()}``)
    is written into the same folder; ``rope_moments`` (cache layer -> query moment) as its query-aware RoPE rounding
    (``quantmla_rope_rounding.st``, :mod:`quantmla.calibrate.query_moments`), which loading the folder attaches;
    ``rope_rotations`` (cache layer -> post-RoPE rotation, only beside a moment) go into the same file, and
    ``rope_rounding_meta`` into its metadata (with the method).
    Everything goes to a temp folder first, a completion manifest last, then one
    rename (:func:`quantmla.artifacts.staged`): a failure or interrupt never leaves a half-written checkpoint at
    ``out_dir``, and without ``force`` an existing ``out_dir`` -- also one that appears while this runs -- is never
    replaced (:class:`FileExistsError`). With ``force`` the old folder is set aside, swapped, then deleted.
    """
    from quantmla.artifacts import staged, write_json

    out = Path(out_dir)
    if not isinstance(quant_config, dict):
        raise TypeError("quant_config must be a dict (see make_quant_config)")
    extra_json = dict(extra_json or {})
    bad = [n for n in extra_json if os.path.basename(n) != n or n in (QUANT_CONFIG_NAME, "config.json")]
    if bad:
        raise ValueError(f"extra_json names must be plain file names other than config files, got {bad}")
    json.dumps([quant_config, extra_json, rope_rounding_meta])  # fail before writing anything if not serializable
    if rope_rotations and not rope_moments:
        raise ValueError("rope_rotations are stored with the query moments their rounding plans are fitted to")
    with staged(str(out), force=force, key={"kind": "fused", "method": quant_config.get("method")}) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, QUANT_CONFIG_NAME), "w") as f:
            json.dump(quant_config, f, indent=2, sort_keys=True)
        for name, obj in extra_json.items():
            write_json(tmp, name, obj)
        if rope_moments:
            from quantmla.calibrate.query_moments import save_rounding_file

            meta = {"method": quant_config.get("method"), **(rope_rounding_meta or {})}
            save_rounding_file(tmp, rope_moments, meta, rotations=rope_rotations)
    return out


def load_quant_config(model_dir: str | os.PathLike) -> dict | None:
    """The ``quantmla.json`` of a fused checkpoint, or None for a plain checkpoint."""
    p = Path(model_dir) / QUANT_CONFIG_NAME
    if not p.exists():
        return None
    with open(p) as f:
        d = json.load(f)
    v = d.get("quantmla_version")
    if v != QUANT_CONFIG_VERSION:
        raise ValueError(f"{p}: quantmla_version {v!r} is not supported (expected {QUANT_CONFIG_VERSION})")
    return d
