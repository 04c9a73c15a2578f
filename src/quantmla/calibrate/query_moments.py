"""The query second moments that query-aware RoPE rounding (:mod:`quantmla.quant.rounding`) is fitted to.

Per attention layer, ``H = sum over (query, key) pairs read from the packed cache of p(query, key) q q^T``: the
rotated RoPE queries ``q`` [Dr] of every head, weighted by the full-precision attention probability they give the
key (an error on a key nobody attends costs nothing), over calibration text run through the model *with its
transforms folded* (so ``H`` is in the coordinates the cache stores). The first ``sink`` keys and each query's last
``local`` keys are left out, as the runtime keeps them in BF16. Stored normalized to unit mean diagonal (fp16 in a
transforms file: ``layers.i.rope.query_moment``).
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.calibrate.blocks import iter_attention_inputs
from quantmla.calibrate.objectives import attention_probs, layer_inputs
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention
from quantmla.quant.rounding import ROPE_ROUNDING_ATTR, fit_rope_rounding


@torch.no_grad()
def query_moments(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    sink: int = 4,
    local: int = 128,
    query_stride: int = 4,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> dict[int, torch.Tensor]:
    """{cache layer index: H [Dr, Dr] fp32, unit mean diagonal} of ``model`` on ``tokens`` [N, T] (every
    ``query_stride``-th position from ``local`` on is a query: keys before ``local`` are all in the BF16 window)."""
    if tokens.dim() != 2 or tokens.shape[1] <= local + 1:
        raise ValueError(f"tokens must be [N, T] with T > local + 1 = {local + 1} (queries that read packed keys), "
                         f"got {tuple(tokens.shape)}")  # fmt: skip
    spec = MLASpec.from_config(model.config)
    index = {id(a): i for i, a in iter_mla_attention(model)}
    dev = torch.device(device)
    qidx = torch.arange(local, tokens.shape[1], query_stride)
    out = {}
    for attn, hidden, cos, sin in iter_attention_inputs(model, tokens, batch_size, dev, progress):
        w = extract_layer_weights(attn)
        h = torch.zeros(spec.qk_rope_head_dim, spec.qk_rope_head_dim, dtype=torch.float64, device=dev)
        for j in range(0, hidden.shape[0], batch_size):
            x = layer_inputs(w, spec, hidden[j : j + batch_size].to(dev), cos.to(dev), sin.to(dev), qidx, sink, local)
            p = attention_probs(x, spec)  # [B, H, Tq, S]
            weight = (p * x.quant_mask.to(p.dtype)).sum(-1)  # [B, H, Tq]: the probability it gives packed keys
            h += torch.einsum("bht,bhtr,bhtq->rq", weight, x.q_pe, x.q_pe).double()
        mean = h.diagonal().mean()
        out[index[id(attn)]] = (h / mean if mean > 0 else h).float().cpu()
    return out


def attach_rope_rounding(model: nn.Module, moments: dict[int, torch.Tensor]) -> int:
    """Fit a plan to each layer's moment and attach it to the attention module (where
    :func:`quantmla.cache.hf.rope_rounding_of` finds it); returns the number of layers given one."""
    attns = dict(iter_mla_attention(model))
    for i in moments:
        if i not in attns:
            raise ValueError(f"a query moment for layer {i}; the model has {len(attns)} attention layers")
    for i, m in moments.items():
        setattr(attns[i], ROPE_ROUNDING_ATTR, fit_rope_rounding(m))
    return len(moments)


__all__ = ["attach_rope_rounding", "query_moments"]
