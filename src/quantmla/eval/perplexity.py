"""Perplexity with a fixed token budget and context length, through any cache format.

The first ``n_tokens`` tokens of a corpus split (:func:`quantmla.data.corpus.token_stream`) are cut into
non-overlapping windows of ``context`` tokens; each window is one prefill forward into a fresh cache of the
requested format (so every key a query reads went through that cache), and every token but the first of
each window is scored. Perplexity = exp(mean negative log-likelihood over the scored tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from quantmla.eval.runtime import DEFAULT_CACHE, CacheSpec, forward_logits, make_cache, prepare_model


@dataclass(frozen=True)
class PerplexityResult:
    format: str
    perplexity: float
    nll: float  # mean negative log-likelihood (nats / token)
    scored_tokens: int
    context: int
    windows: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def perplexity(
    model, ids: torch.Tensor, *, context: int = 1024, cache: CacheSpec = DEFAULT_CACHE, progress: bool = False
) -> PerplexityResult:
    """Perplexity of ``model`` on token ids ``ids`` [N] in windows of ``context`` tokens (N // context windows)."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D [N], got shape {tuple(ids.shape)}")
    n_win = ids.numel() // context
    if n_win == 0:
        raise ValueError(f"need at least one window: {ids.numel()} tokens < context {context}")
    prepare_model(model)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    it = range(n_win)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"ppl {cache.label()}", leave=False)
    for w in it:
        x = ids[w * context : (w + 1) * context].to(device)[None]  # [1, C]
        logits = forward_logits(model, x, make_cache(model, cache))  # [1, C, V]
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
        total += float(nll)
        count += context - 1
    mean = total / count
    return PerplexityResult(cache.format, math.exp(mean), mean, count, context, n_win)
