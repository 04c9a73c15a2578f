"""Running a model with a given KV-cache format: model loading, cache construction, greedy decoding.

``format`` names follow :mod:`quantmla.quant.formats` (``bf16``, ``c8r8``, ``c4r4``, ``c2r4`` ...), plus
``fp32`` = the model's own unquantized cache (transformers ``DynamicCache``).

- MLA models (``deepseek_v2/v3``, ``quantmla_mla`` ...): the cache is the lead's dual-path
  ``quantmla.cache.hf.QuantMLACache(config, fmt, policy)`` and attention runs in absorbed form
  (:func:`quantmla.mla.attention.enable_absorbed_attention`), so the mixed-precision policy is applied per
  query even inside one prefill forward (query ``t`` reads its own sink/local window in full precision).
- GQA / MHA models (the original Llama before conversion): ``bf16`` rounds keys and values to BF16 in a
  ``DynamicCache``; low-bit formats are MLA-only and raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_mla(model) -> bool:
    from quantmla.mla.spec import SUPPORTED_MODEL_TYPES

    return getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES


def _dynamic_cache_class():
    from transformers import DynamicCache

    class BF16DynamicCache(DynamicCache):
        """DynamicCache that stores keys and values rounded to BF16 (returned in the model's dtype)."""

        def update(self, key_states, value_states, *args, **kwargs):
            k = key_states.to(torch.bfloat16).to(key_states.dtype)
            v = value_states.to(torch.bfloat16).to(value_states.dtype)
            return super().update(k, v, *args, **kwargs)

    return DynamicCache, BF16DynamicCache


@dataclass(frozen=True)
class CacheSpec:
    """Which cache to build for each sequence: format name + mixed-precision policy (sink, local)."""

    format: str = "bf16"
    sink: int = 4
    local: int = 128

    def label(self) -> str:
        return self.format if self.format in ("fp32", "bf16") else f"{self.format}(s{self.sink},l{self.local})"


DEFAULT_CACHE = CacheSpec()


def make_cache(model, spec: CacheSpec):
    """A fresh cache for one sequence (or batch) of ``model`` with ``spec``."""
    fmt = spec.format.lower()
    dyn, bf16 = _dynamic_cache_class()
    if fmt == "fp32":
        return dyn(config=model.config)
    if not is_mla(model):
        if fmt == "bf16":
            return bf16(config=model.config)
        raise ValueError(
            f"cache format {spec.format!r} needs an MLA model; {model.config.model_type!r} is GQA/MHA "
            "(convert it first with `quantmla convert`), or use --format bf16 / fp32"
        )
    from quantmla.cache.hf import QuantMLACache, rope_rounding_of  # lazy: the cache package is optional at import
    from quantmla.quant.formats import CachePolicy

    # the model's query-aware RoPE rounding plans, where folded transforms brought them (round to nearest if none)
    return QuantMLACache(model.config, fmt, CachePolicy(sink=spec.sink, local=spec.local),
                         rope_rounding=rope_rounding_of(model))  # fmt: skip


def prepare_model(model):
    """Put ``model`` in eval mode and, for MLA models, patch attention to absorbed form (idempotent)."""
    model.eval()
    if is_mla(model):
        from quantmla.mla.attention import enable_absorbed_attention

        enable_absorbed_attention(model)
    return model


def cache_kwarg(model) -> str:
    """The forward kwarg that takes the cache: ``cache`` (transformers >= 5.2x) or ``past_key_values`` (5.17)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def forward_logits(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits [B, T, V] (fp32) of ``input_ids`` [B, T] written into ``cache``."""
    out = model(input_ids=input_ids, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits.float()


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, cache, max_new_tokens: int, eos_ids=(), stop=None) -> list[int]:
    """Greedy continuation (token ids) of one prompt ``input_ids`` [1, T] through ``cache``; ends at an EOS
    token, after ``max_new_tokens`` or when ``stop(generated_ids)`` is true."""
    logits = forward_logits(model, input_ids, cache)[:, -1]  # [1, V]
    out: list[int] = []
    eos = set(int(e) for e in eos_ids)
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax(-1))
        if nxt in eos:
            break
        out.append(nxt)
        if stop is not None and stop(out):
            break
        logits = forward_logits(model, torch.tensor([[nxt]], device=input_ids.device), cache)[:, -1]
    return out


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = []
    for v in (getattr(model.generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if v is None:
            continue
        ids.extend(v if isinstance(v, (list, tuple)) else [v])
    return sorted(set(int(i) for i in ids))
