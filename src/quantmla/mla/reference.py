"""The exact fp32 reference of MLA attention in absorbed form -- the oracle every cache and kernel is checked against.

Absorbed form (no per-head keys or values are ever built): with the cached latent ``c_kv`` [B, S, Dc] and the
rotated shared RoPE key ``k_pe`` [B, S, Dr],

    q_lat  = q_nope @ W_UK                                   # [B, H, T, Dc]
    logits = (q_lat . c_kv + q_pe . k_pe) * scale            # [B, H, T, S]
    o_lat  = softmax(logits) @ c_kv                          # [B, H, T, Dc]
    out    = o_proj(o_lat @ W_UV^T)                          # [B, T, D]

which equals the expanded form ``softmax((q_nope.k_nope + q_pe.k_pe) * scale) @ v`` with ``k_nope = c_kv W_UK^T``
and ``v = c_kv W_UV^T``. Everything here computes in fp32 (float64 inputs stay float64).

Masks: ``None`` means causal with the T queries being the last T of the S keys (query t sees keys
``0 .. S - T + t``); otherwise a bool tensor broadcastable to [B, H, T, S], True = attend. A row with no key to
attend to yields zeros (and log-sum-exp ``-inf``), never NaN. Every one of the S keys passed in must be finite,
masked ones included (a masked key gets weight 0, and 0 * NaN is NaN): pass only the valid tokens of a cache.
"""

from __future__ import annotations

import torch

from quantmla.mla.rope import apply_rope
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import MLALayerWeights


def _compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def causal_mask(t: int, s: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool [T, S]: query t (the last T of S positions) may attend key j iff ``j <= S - T + t``."""
    if t > s:
        raise ValueError(f"causal mask needs T <= S, got T={t}, S={s}")
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # [T, 1]
    return torch.arange(s, device=device)[None, :] <= q_pos  # [T, S]


def absorbed_attention_lse(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent-space attention output ``o_lat`` [B, H, T, Dc] and log-sum-exp of the scaled logits [B, H, T].

    ``q_lat`` [B, H, T, Dc], ``q_pe`` [B, H, T, Dr], ``c_kv`` [B, S, Dc], ``k_pe`` [B, S, Dr]. The LSE is over the
    allowed keys of the logits after ``scale`` (natural log); ``-inf`` for a fully masked row.
    """
    _check_shapes(q_lat, q_pe, c_kv, k_pe)
    dt = _compute_dtype(q_lat, q_pe, c_kv, k_pe)
    q_lat, q_pe, c_kv, k_pe = (x.to(dt) for x in (q_lat, q_pe, c_kv, k_pe))
    t, s = q_lat.shape[2], c_kv.shape[1]
    logits = torch.einsum("bhtc,bsc->bhts", q_lat, c_kv) + torch.einsum("bhtr,bsr->bhts", q_pe, k_pe)
    logits = logits * scale  # [B, H, T, S]
    allowed = causal_mask(t, s, logits.device) if mask is None else mask.to(device=logits.device, dtype=torch.bool)
    logits = logits.masked_fill(~allowed, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)  # [B, H, T, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(logits - row_max)  # [B, H, T, S]; exactly 0 where masked
    denom = p.sum(dim=-1, keepdim=True)  # [B, H, T, 1]
    o_lat = torch.einsum("bhts,bsc->bhtc", p, c_kv) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (row_max + torch.log(denom)).squeeze(-1)  # [B, H, T]; log(0) = -inf for empty rows
    return o_lat, lse


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent-space attention output ``o_lat`` [B, H, T, Dc] (fp32); see ``absorbed_attention_lse``."""
    return absorbed_attention_lse(q_lat, q_pe, c_kv, k_pe, scale, mask)[0]


def _check_shapes(q_lat, q_pe, c_kv, k_pe) -> None:
    if q_lat.dim() != 4 or q_pe.dim() != 4 or c_kv.dim() != 3 or k_pe.dim() != 3:
        raise ValueError(
            "expected q_lat [B, H, T, Dc], q_pe [B, H, T, Dr], c_kv [B, S, Dc], k_pe [B, S, Dr]; got shapes "
            f"{tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(c_kv.shape)}, {tuple(k_pe.shape)}"
        )
    b, _, t, dc = q_lat.shape
    ok = (
        q_pe.shape[0] == b
        and q_pe.shape[2] == t
        and q_pe.shape[1] == q_lat.shape[1]
        and c_kv.shape[0] == b
        and c_kv.shape[2] == dc
        and k_pe.shape[:2] == c_kv.shape[:2]
        and k_pe.shape[2] == q_pe.shape[3]
    )
    if not ok:
        raise ValueError(
            "inconsistent absorbed-attention shapes: q_lat "
            f"{tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)}"
        )


# ---- the whole layer in absorbed form, from MLALayerWeights -------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """transformers' RMSNorm (normalize in fp32, cast back, multiply by the gain); identity when weight is None."""
    if weight is None:
        return x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def project_queries(w: MLALayerWeights, spec: MLASpec, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_nope`` [B, H, T, Dn] and the *unrotated* ``q_pe`` [B, H, T, Dr] from ``hidden`` [B, T, D] (q_scale in)."""
    if w.q_proj is not None:
        q = _linear(hidden, w.q_proj)
    else:
        q = _linear(rms_norm(_linear(hidden, w.q_a_proj, w.q_a_bias), w.q_a_norm, w.q_a_norm_eps), w.q_b_proj)
    b, t = hidden.shape[:2]
    q = q.view(b, t, spec.num_heads, spec.qk_head_dim).transpose(1, 2)  # [B, H, T, Dn + Dr]
    q_nope, q_pe = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
    if spec.q_scale != 1.0:
        q_nope, q_pe = q_nope * spec.q_scale, q_pe * spec.q_scale
    return q_nope, q_pe


def project_latent(w: MLALayerWeights, spec: MLASpec, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached latent ``c_kv`` [B, T, Dc] (after the norm and kv_scale) and the unrotated ``k_pe`` [B, T, Dr]."""
    c_kv = rms_norm(_linear(hidden, w.kv_a_latent, w.kv_a_latent_bias), w.kv_norm, w.kv_norm_eps)
    if spec.kv_scale != 1.0:
        c_kv = c_kv * spec.kv_scale
    return c_kv, _linear(hidden, w.kv_a_rope, w.kv_a_rope_bias)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_lat`` [B, H, T, Dc] = ``q_nope`` [B, H, T, Dn] @ ``W_UK`` [H, Dn, Dc], in fp32."""
    dt = _compute_dtype(q_nope, w_uk)
    return torch.einsum("bhtn,hnc->bhtc", q_nope.to(dt), w_uk.to(dt))


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Per-head values merged: ``o_lat`` [B, H, T, Dc] @ ``W_UV^T`` -> [B, T, H * Dv], in fp32."""
    dt = _compute_dtype(o_lat, w_uv)
    out = torch.einsum("bhtc,hvc->bthv", o_lat.to(dt), w_uv.to(dt))  # [B, T, H, Dv]
    return out.reshape(*out.shape[:2], -1)


def absorbed_layer_forward(
    w: MLALayerWeights,
    spec: MLASpec,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past_c_kv: torch.Tensor | None = None,
    past_k_pe: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MLA attention layer in absorbed form (prefill when there is no past, decode / chunked prefill otherwise).

    ``hidden`` [B, T, D]; ``cos``/``sin`` [B or 1, T, Dr/2] per-pair angles of the T new positions (from
    ``rope.rope_cos_sin``); ``past_c_kv`` [B, P, Dc] / ``past_k_pe`` [B, P, Dr] the cached tokens. Returns the
    attention output [B, T, D] (in ``hidden``'s dtype) and the full ``c_kv`` [B, P + T, Dc] and rotated ``k_pe``
    [B, P + T, Dr] to cache.
    """
    q_nope, q_pe = project_queries(w, spec, hidden)
    c_kv, k_pe = project_latent(w, spec, hidden)
    q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], spec.rope_pairing, spec.rope_cache_pairing)
    k_pe = apply_rope(k_pe, cos, sin, spec.rope_pairing, spec.rope_cache_pairing)
    if past_c_kv is not None:
        c_kv = torch.cat((past_c_kv.to(c_kv.dtype), c_kv), dim=1)
        k_pe = torch.cat((past_k_pe.to(k_pe.dtype), k_pe), dim=1)
    o_lat = absorbed_attention(absorb_query(q_nope, w.w_uk), q_pe, c_kv, k_pe, spec.softmax_scale, mask)
    out = _linear(expand_output(o_lat, w.w_uv).to(hidden.dtype), w.o_proj, w.o_bias)
    return out, c_kv, k_pe
