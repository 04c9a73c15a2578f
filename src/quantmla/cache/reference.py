"""Torch reference of absorbed MLA attention over a dual-path cache with the per-query mixed policy.

For queries at positions ``t = S - T .. S - 1`` and cached tokens ``j = 0 .. S - 1``:
``use_full(t, j) = j < sink or j > t - local`` (full-precision copy) else the dequantized packed copy.
Scores ``s_tj = scale * (q_lat_t . c_j + q_pe_t . k_pe_j)`` with ``c_j, k_pe_j`` from the selected copy,
one softmax over the valid ``j``, and ``o_lat_t = sum_j p_tj c_j`` with the same selected copy (the
reconstructed content serves both matching and aggregation). All math in fp32.
"""

from __future__ import annotations

import torch

from quantmla.mla.reference import absorbed_attention, causal_mask


def _softmax_masked(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).clamp_min(-1e30)  # fully masked rows: avoid inf - inf
    e = torch.exp(scores - m)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def mixed_policy_attention(layer, q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float, mask=None) -> torch.Tensor:
    """o_lat [B, H, T, Dc] (fp32) of ``layer`` (a :class:`~quantmla.cache.dual_path.DualPathLayer`)."""
    b, h, t, dc = q_lat.shape
    s = layer.length
    if q_pe.shape[:3] != (b, h, t):
        raise ValueError(f"q_lat {tuple(q_lat.shape)} and q_pe {tuple(q_pe.shape)} disagree on [B, H, T]")
    if t > s:
        raise ValueError(f"{t} queries but only {s} cached tokens: write the new tokens before attending")
    dev = q_lat.device
    ql, qr = q_lat.float(), q_pe.float()
    c_q, r_q = layer.dequantized()  # [B, S, Dc], [B, S, Dr]
    allowed = causal_mask(t, s, dev) if mask is None else mask.to(dev).bool()
    allowed = allowed.expand(b, h, t, s) if allowed.dim() == 4 else allowed.expand(b, h, t, s)

    def scores_of(c, r):  # -> [B, H, T, S']
        return (torch.einsum("bhtd,bsd->bhts", ql, c) + torch.einsum("bhtd,bsd->bhts", qr, r)) * scale

    if not layer.fmt.is_quantized:
        return absorbed_attention(ql, qr, c_q, r_q, scale, allowed)
    scores = scores_of(c_q, r_q)  # every token from its packed copy

    # Full-precision copies available to this step (sink, local window before this write, new tokens): P columns.
    fp_pos, fp_vals = layer.fresh if layer.fresh is not None else layer.protected()
    c_f, r_f = fp_vals[..., :dc].float(), fp_vals[..., dc:].float()  # [B, P, Dc], [B, P, Dr]
    pol = layer.policy
    q_pos = torch.arange(s - t, s, device=dev)[:, None]  # [T, 1]
    j = torch.arange(s, device=dev)[None, :]
    needs_full = (j < pol.sink) | (j > q_pos - pol.local)  # [T, S]
    avail = torch.zeros(s, dtype=torch.bool, device=dev)
    avail[fp_pos] = True
    if bool((needs_full & ~avail[None, :] & allowed.any(dim=(0, 1))).any()):
        raise RuntimeError("internal error: the policy asks for a full-precision copy that is not held")
    use = needs_full[:, fp_pos]  # [T, P]
    scores[..., fp_pos] = torch.where(use, scores_of(c_f, r_f), scores[..., fp_pos])
    p = _softmax_masked(scores, allowed)
    p_f = p[..., fp_pos] * use  # weights read from the full-precision copies [B, H, T, P]
    p[..., fp_pos] -= p_f
    return torch.einsum("bhts,bsd->bhtd", p, c_q) + torch.einsum("bhtp,bpd->bhtd", p_f, c_f)
