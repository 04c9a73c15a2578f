"""The function-aligned objectives of QuantMLA, computed in fp32 from one attention layer's input hidden states.

* Content: the normalized error of the attention output (before ``o_proj``'s bias) when the cached latent is
  replaced by ``QDQ(c T) T^-1`` -- exactly what the fused model computes from a quantized cache. The error
  enters both the matching (``q_lat . c``) and the aggregation (``P c``), which is why the output, not the latent,
  is the target.
* RoPE: the normalized error of the positional logits ``q_pe . k_pe`` (causal pairs) when the cached RoPE key is
  replaced by ``QDQ(k_pe z) / z`` -- equivalently ``(q_pe z/|z|^2) . QDQ(k_pe z)``, what the fused model computes.

Keys the cache policy keeps in full precision (the first ``sink`` tokens and each query's last ``local`` tokens) are
read exactly in both objectives, as at run time. Both are normalized mean squared errors (NMSE: squared error over
squared reference, summed over the batch), so their values are comparable across layers and with the analysis
module. Rounding passes gradients straight through (STE) while the per-group step and offset stay differentiable
functions of the input (LSQ-style, see :func:`ste_fake_quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from quantmla.calibrate.transforms import ContentTransform, RopeTransform
from quantmla.mla.reference import absorb_query, absorbed_attention, expand_output, project_latent, project_queries
from quantmla.mla.rope import apply_rope
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import MLALayerWeights
from quantmla.quant.quantize import fake_quantize
from quantmla.quant.spec import QuantSpec


def ste_fake_quantize(x: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """Quantize-dequantize whose forward value is exactly :func:`fake_quantize` (what the cache will hold) and
    whose gradient treats only the *rounding* as the identity (straight-through), LSQ-style.

    Per group the step ``s`` and offset ``m`` are the differentiable min/max functions of ``x`` that the
    quantizer uses, and ``q = u + (round(u) - u).detach()`` with ``u = (x - m) / s``, so ``x_hat = q s + m`` has
    ``d x_hat / d x = 1`` for elements inside the range and ``d x_hat / d s = round(u) - u`` (the rounding
    residual): a transform that shrinks a group's range is rewarded. (Passing the whole QDQ straight through
    would make ``QDQ(x T) T^-1`` look like the identity to the gradient and leave ``T`` unlearnable.)
    Identity when ``spec`` is None.
    """
    if spec is None:
        return x
    with torch.no_grad():
        exact = fake_quantize(x.detach(), spec).to(x.dtype)
    g = spec.group_size
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)  # [..., G, g]
    if spec.symmetric:
        qmax = (1 << (spec.bits - 1)) - 1
        step = (xg.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(1e-8)
        u = xg / step
        q = (u + (torch.round(u) - u).detach()).clamp(-qmax, qmax)
        soft = q * step
    else:
        qmax = (1 << spec.bits) - 1
        lo = xg.amin(dim=-1, keepdim=True)
        step = ((xg.amax(dim=-1, keepdim=True) - lo) / qmax).clamp_min(1e-8)
        u = (xg - lo) / step
        q = (u + (torch.round(u) - u).detach()).clamp(0, qmax)
        soft = q * step + lo
    soft = soft.reshape(x.shape)
    return soft + (exact - soft).detach()


@dataclass
class LayerInputs:
    """What both objectives need for a batch, all fp32 and without gradient.

    q_lat [B, H, Tq, Dc], q_pe [B, H, Tq, Dr] (rotated, cache layout), c [B, S, Dc], k_pe [B, S, Dr] (rotated,
    cache layout), mask [Tq, S] (True = the query may attend the key), ref_out [B, Tq, D] (attention output
    through ``o_proj`` without bias, computed lazily).
    """

    q_lat: torch.Tensor
    q_pe: torch.Tensor
    c: torch.Tensor
    k_pe: torch.Tensor
    mask: torch.Tensor
    ref_out: torch.Tensor | None = None
    quant_mask: torch.Tensor | None = None  # [Tq, S] True = the query reads the key's quantized copy
    reads_all: bool = False  # quant_mask equals mask (no sink, no local window): known on the host, no device read

    def select(self, seqs: torch.Tensor, queries: torch.Tensor | None) -> LayerInputs:
        """Sequences ``seqs`` and (of inputs built with every query) the query positions ``queries``."""
        q_lat, q_pe, mask, ref, qm = self.q_lat[seqs], self.q_pe[seqs], self.mask, None, self.quant_mask
        if self.ref_out is not None:
            ref = self.ref_out[seqs]
        if queries is not None:
            q_lat, q_pe, mask = q_lat[:, :, queries], q_pe[:, :, queries], mask[queries]
            ref = None if ref is None else ref[:, queries]
            qm = None if qm is None else qm[queries]
        return LayerInputs(q_lat, q_pe, self.c[seqs], self.k_pe[seqs], mask, ref, qm, self.reads_all)

    @staticmethod
    def cat(parts: list[LayerInputs]) -> LayerInputs:
        """Concatenate along the batch (same query positions in every part)."""
        ref = None if any(p.ref_out is None for p in parts) else torch.cat([p.ref_out for p in parts])
        return LayerInputs(
            torch.cat([p.q_lat for p in parts]),
            torch.cat([p.q_pe for p in parts]),
            torch.cat([p.c for p in parts]),
            torch.cat([p.k_pe for p in parts]),
            parts[0].mask,
            ref,
            parts[0].quant_mask,
            parts[0].reads_all,
        )


def sample_queries(seq_len: int, n: int, gen: torch.Generator | None) -> torch.Tensor | None:
    """Sorted positions of ``n`` distinct query tokens (None = all, when ``n`` is 0 or >= ``seq_len``)."""
    if n <= 0 or n >= seq_len:
        return None
    return torch.randperm(seq_len, generator=gen)[:n].sort().values


@torch.no_grad()
def layer_inputs(
    w: MLALayerWeights,
    spec: MLASpec,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    query_index: torch.Tensor | None = None,
    sink: int = 0,
    local: int = 0,
) -> LayerInputs:
    """Project ``hidden`` [B, S, D] through the layer; ``cos``/``sin`` [1 or B, S, Dr/2]; queries at
    ``query_index`` [Tq] (None = all S). ``sink``/``local``: the cache policy's full-precision tokens -- the
    first ``sink`` positions and, for a query at position t, the last ``local`` positions up to t -- which the
    objectives leave unquantized, as the runtime does."""
    hidden = hidden.to(w.o_proj.dtype)
    s = hidden.shape[1]
    q_nope, q_pe = project_queries(w, spec, hidden)  # [B, H, S, Dn], [B, H, S, Dr] (unrotated)
    c, k_pe = project_latent(w, spec, hidden)  # [B, S, Dc], [B, S, Dr]
    cos, sin = cos[:, :s].float(), sin[:, :s].float()
    pairing, out = spec.rope_pairing, spec.rope_cache_pairing
    q_pe = apply_rope(q_pe.float(), cos[:, None], sin[:, None], pairing, out)
    k_pe = apply_rope(k_pe.float(), cos, sin, pairing, out)
    qpos = torch.arange(s, device=hidden.device) if query_index is None else query_index.to(hidden.device)
    q_nope, q_pe = q_nope[:, :, qpos], q_pe[:, :, qpos]
    kpos = torch.arange(s, device=hidden.device)[None, :]
    mask = kpos <= qpos[:, None]  # [Tq, S]
    quant = mask & (kpos >= sink) & (kpos <= qpos[:, None] - local)  # [Tq, S] read from the packed copy
    # quant == mask exactly when neither the first key (sink) nor a query's own position (local) is kept exact
    reads_all = (sink <= 0 and local <= 0) or qpos.numel() == 0
    q_lat = absorb_query(q_nope.float(), w.w_uk.float())
    return LayerInputs(q_lat, q_pe, c.float(), k_pe, mask, None, quant, reads_all)


def attention_output(x: LayerInputs, w: MLALayerWeights, spec: MLASpec, c: torch.Tensor, k_pe: torch.Tensor):
    """``o_proj`` (no bias) of the attention of ``x``'s queries over the latent ``c`` [B, S, Dc] and ``k_pe``."""
    o_lat = absorbed_attention(x.q_lat, x.q_pe, c, k_pe, spec.softmax_scale, x.mask)  # [B, H, Tq, Dc]
    return F.linear(expand_output(o_lat, w.w_uv.float()), w.o_proj.float())  # [B, Tq, D]


def mixed_attention_output(x: LayerInputs, w: MLALayerWeights, spec: MLASpec, c_hat: torch.Tensor, k_hat):
    """Like :func:`attention_output`, but where ``x.quant_mask`` is True the query reads the reconstructed
    ``c_hat``/``k_hat`` and elsewhere the exact ``x.c``/``x.k_pe`` (the mixed-precision cache policy)."""
    qm = x.quant_mask
    if qm is None or x.reads_all:
        return attention_output(x, w, spec, c_hat, k_hat)
    exact = torch.einsum("bhtc,bsc->bhts", x.q_lat, x.c) + torch.einsum("bhtr,bsr->bhts", x.q_pe, x.k_pe)
    quant = torch.einsum("bhtc,bsc->bhts", x.q_lat, c_hat) + torch.einsum("bhtr,bsr->bhts", x.q_pe, k_hat)
    logits = torch.where(qm, quant, exact) * spec.softmax_scale
    p = torch.softmax(logits.masked_fill(~x.mask, float("-inf")), dim=-1)  # [B, H, Tq, S]
    p = torch.nan_to_num(p)
    qf = qm.to(p.dtype)
    o_lat = torch.einsum("bhts,bsc->bhtc", p * qf, c_hat) + torch.einsum("bhts,bsc->bhtc", p * (1 - qf), x.c)
    return F.linear(expand_output(o_lat, w.w_uv.float()), w.o_proj.float())  # [B, Tq, D]


def _nmse(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return err.pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30)


def reference_output(x: LayerInputs, w: MLALayerWeights, spec: MLASpec) -> torch.Tensor:
    if x.ref_out is None:
        with torch.no_grad():
            x.ref_out = attention_output(x, w, spec, x.c, x.k_pe)
    return x.ref_out


def content_objective(
    x: LayerInputs, w: MLALayerWeights, spec: MLASpec, t: ContentTransform | None, qspec: QuantSpec | None
) -> torch.Tensor:
    """Attention-output NMSE with the latent cached as ``QDQ(c T)`` (RoPE path exact)."""
    ref = reference_output(x, w, spec)
    qdq = lambda y: ste_fake_quantize(y, qspec)  # noqa: E731
    c_hat = qdq(x.c) if t is None else t.roundtrip(x.c, qdq)
    return _nmse(mixed_attention_output(x, w, spec, c_hat, x.k_pe) - ref, ref)


def attention_probs(x: LayerInputs, spec: MLASpec) -> torch.Tensor:
    """Full-precision attention probabilities [B, H, Tq, S] of ``x``'s queries (no gradient)."""
    with torch.no_grad():
        logits = torch.einsum("bhtc,bsc->bhts", x.q_lat, x.c) + torch.einsum("bhtr,bsr->bhts", x.q_pe, x.k_pe)
        p = torch.softmax((logits * spec.softmax_scale).masked_fill(~x.mask, float("-inf")), dim=-1)
        return torch.nan_to_num(p)


def rope_objective(
    x: LayerInputs, spec: MLASpec, r: RopeTransform | None, qspec: QuantSpec | None, weighting: str = "uniform"
) -> torch.Tensor:
    """Positional-logit NMSE over causal pairs with the RoPE key cached as ``QDQ(k_pe z)``.

    ``weighting="attention"``: each (query, key) pair's squared logit error (and reference) weighted by the
    full-precision attention probability of that pair (an error on a key the query barely attends moves the
    output little); ``"uniform"``: every causal pair counts the same (the paper's objective)."""
    pairing = spec.rope_cache_pairing
    if r is None:
        k_hat = ste_fake_quantize(x.k_pe, qspec)
    else:
        k_hat = r.key_inverse(ste_fake_quantize(r.key(x.k_pe, pairing), qspec), pairing)
    m = x.mask.to(x.q_pe.dtype)  # [Tq, S]
    mq = m if x.quant_mask is None else x.quant_mask.to(x.q_pe.dtype)  # only keys read from the packed copy
    ref = torch.einsum("bhtr,bsr->bhts", x.q_pe, x.k_pe) * m
    err = torch.einsum("bhtr,bsr->bhts", x.q_pe, k_hat - x.k_pe) * mq
    if weighting == "attention":
        p = attention_probs(x, spec)  # [B, H, Tq, S]
        return (p * err.pow(2)).sum() / (p * ref.pow(2)).sum().clamp_min(1e-30)
    if weighting != "uniform":
        raise ValueError(f"unknown RoPE objective weighting {weighting!r}; use uniform or attention")
    return _nmse(err, ref)
