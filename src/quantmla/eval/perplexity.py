"""Perplexity with a fixed token budget and context length, through any cache format.

The first ``n_tokens`` tokens of a corpus split (:func:`quantmla.data.corpus.token_stream`) are cut into
non-overlapping windows of ``context`` tokens; each window is one prefill forward into a fresh cache of the
requested format (so every key a query reads went through that cache), and every token but the first of
each window is scored. Perplexity = exp(mean negative log-likelihood over the scored tokens).

Perplexity moves little when a cache format is nearly lossless, and its sign can flip by chance (a perturbation
can make a wrong token likelier). The sharper measure of what a format keeps is the KL divergence from the
full-precision model's next-token distribution, KL(P_fp || P_cache) per token: pass the reference distributions
from :func:`reference_logprobs` (the model's own forward without any cache, same windows) as ``reference``.
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
    kl_to_reference: float | None = None  # mean KL(P_fp || P_cache) in nats / token, when a reference was given
    top1_agreement: float | None = None  # share of positions whose argmax matches the reference's

    def to_dict(self) -> dict:
        return asdict(self)


def _windows(ids: torch.Tensor, context: int) -> int:
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D [N], got shape {tuple(ids.shape)}")
    n_win = ids.numel() // context
    if n_win == 0:
        raise ValueError(f"need at least one window: {ids.numel()} tokens < context {context}")
    return n_win


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor, *, context: int = 1024) -> torch.Tensor:
    """Next-token log-probabilities [W, context, V] (fp32, CPU) of ``model``'s own forward pass without any
    cache, over the same windows :func:`perplexity` uses: the reference for its ``kl_to_reference``.
    Memory: 4 * N * V bytes (N = tokens, V = vocabulary)."""
    n_win = _windows(ids, context)
    model.eval()
    device = next(model.parameters()).device
    out = []
    for w in range(n_win):
        x = ids[w * context : (w + 1) * context].to(device)[None]  # [1, C]
        out.append(model(x, use_cache=False).logits[0].float().log_softmax(-1).cpu())  # [C, V]
    return torch.stack(out)


@torch.no_grad()
def perplexity(
    model,
    ids: torch.Tensor,
    *,
    context: int = 1024,
    cache: CacheSpec = DEFAULT_CACHE,
    progress: bool = False,
    reference: torch.Tensor | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on token ids ``ids`` [N] in windows of ``context`` tokens (N // context windows).

    ``reference``: :func:`reference_logprobs` of the full-precision model on the same ``ids`` and ``context``;
    when given, the result also carries the mean KL divergence from it over every position of every window and the
    share of positions whose most likely next token agrees with it.
    """
    n_win = _windows(ids, context)
    if reference is not None and tuple(reference.shape[:2]) != (n_win, context):
        raise ValueError(
            f"reference has shape {tuple(reference.shape)}, expected [{n_win}, {context}, V]: build it with "
            "reference_logprobs(model, ids, context=context) on the same ids"
        )
    prepare_model(model)
    device = next(model.parameters()).device
    total, count, kl_total, agree = 0.0, 0, 0.0, 0
    it = range(n_win)
    if progress:
        from quantmla.progress import progress as _progress

        it = _progress(it, f"ppl {cache.label()}")
    for w in it:
        x = ids[w * context : (w + 1) * context].to(device)[None]  # [1, C]
        logits = forward_logits(model, x, make_cache(model, cache))  # [1, C, V]
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
        total += float(nll)
        count += context - 1
        if reference is not None:
            ref = reference[w].to(logits.device)  # [C, V]
            lq = logits[0].float().log_softmax(-1)
            kl_total += float((ref.exp() * (ref - lq)).sum())
            agree += int((lq.argmax(-1) == ref.argmax(-1)).sum())
    mean = total / count
    kl = agree_share = None
    if reference is not None:
        kl, agree_share = kl_total / (n_win * context), agree / (n_win * context)
    return PerplexityResult(cache.format, math.exp(mean), mean, count, context, n_win, kl, agree_share)
