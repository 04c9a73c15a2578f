"""Run a transformers MLA model's attention in absorbed form, over any cache.

``enable_absorbed_attention(model)`` replaces the forward of every MLA attention module (instance attribute, so
``disable_absorbed_attention`` restores the class's own) with one that never re-expands the cached latent
through ``kv_b_proj``: the query is mapped into latent space (``q_lat = q_nope @ W_UK``), attention runs over the
cached ``c_kv`` and ``k_pe``, and the latent output goes through ``W_UV`` and ``o_proj``.

Cache handling, per call:

* ``quantmla.cache.protocol.get_mla_layer(cache, layer_idx)`` returns a layer: ``layer.write(c_kv, k_pe)`` then
  ``o_lat = layer.attend(q_lat, q_pe, scale, mask)`` -- the cache decides storage and attention; on CUDA a chunk of
  several tokens can ask a layer that ``attends_per_head`` for ``W_UV o_lat`` directly (``heads=(q_nope, W_UK,
  W_UV)``: prefill in MHA form, :func:`per_head_prefill`, on by default);
* a plain transformers cache (``DynamicCache`` ...): ``cache.update`` with the model's own 4-D tensors
  ([B, 1, T, Dc], [B, 1, T, Dr]) exactly as the model does, then the fp32 reference over what it returns;
* no cache: attention over the current tokens.

Works with transformers 5.17 (forward kwarg ``past_key_values``, ``update(k, v, layer_idx)``) and 5.24+ (kwarg
``cache``, ``update(k, v, layer_idx, kwargs=...)``): the cache is called in the style it was passed in.
The RoPE angles are the ``position_embeddings`` the model passes (complex ``freqs_cis`` for DeepSeek-V2,
``(cos, sin)`` otherwise), applied with the model's pairing and output layout.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any

import torch
from torch import nn

from quantmla.cache.protocol import get_mla_layer
from quantmla.mla.reference import absorb_query, absorbed_attention, expand_output
from quantmla.mla.rope import apply_rope, cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import iter_mla_attention

_SPEC_ATTR = "_quantmla_spec"


def enable_absorbed_attention(model: nn.Module) -> nn.Module:
    """Patch every MLA attention module of ``model`` to run in absorbed form; returns ``model``. Idempotent.

    Raises ``UnsupportedModelError`` for a model that is not a supported MLA model.
    """
    spec = MLASpec.from_config(model.config)
    for _, attn in iter_mla_attention(model):
        setattr(attn, _SPEC_ATTR, spec)
        attn.forward = types.MethodType(_absorbed_forward, attn)
    return model


def disable_absorbed_attention(model: nn.Module) -> nn.Module:
    """Undo ``enable_absorbed_attention``: every attention module runs its class's own forward again."""
    for _, attn in iter_mla_attention(model):
        if _SPEC_ATTR in attn.__dict__:
            del attn.__dict__[_SPEC_ATTR]
        attn.__dict__.pop("forward", None)
    return model


def is_absorbed(attn: nn.Module) -> bool:
    """True when ``attn``'s forward has been patched by ``enable_absorbed_attention``."""
    return _SPEC_ATTR in attn.__dict__


def attention_mask_to_bool(attention_mask: Any, kv_len: int) -> torch.Tensor | None:
    """The protocol's mask (None = causal, else bool [B, 1, T, S], True = attend) from what transformers passes.

    Accepts None, a 4-D bool mask (True = attend) or a 4-D additive float mask (0 = attend, a very negative
    number or -inf = masked); the key axis is cut to the ``kv_len`` keys actually cached, as transformers does.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"absorbed attention cannot use an attention mask of type {type(attention_mask).__name__}; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    if attention_mask.dim() != 4:
        raise ValueError(f"expected a 4-D attention mask [B, 1, T, S], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _bind_args(attn: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
    """Name positional arguments after the class forward's signature (V2 and V3 order them differently)."""
    if not args:
        return kwargs
    names = [p for p in inspect.signature(type(attn).forward).parameters if p not in ("self", "hidden_states")]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _queries(attn: nn.Module, spec: MLASpec, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_nope`` [B, H, T, Dn], unrotated ``q_pe`` [B, H, T, Dr] through the module's own projections."""
    if getattr(attn, "q_a_proj", None) is None:
        q = attn.q_proj(hidden)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
    b, t = hidden.shape[:2]
    q = q.view(b, t, -1, spec.qk_head_dim).transpose(1, 2)  # [B, H, T, Dn + Dr]
    q_nope, q_pe = torch.split(q, [spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
    if spec.q_scale != 1.0:
        q_nope, q_pe = q_nope * spec.q_scale, q_pe * spec.q_scale
    return q_nope, q_pe


def _latent(attn: nn.Module, spec: MLASpec, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized (and kv_scale'd) ``c_kv`` [B, T, Dc] and unrotated ``k_pe`` [B, T, Dr]."""
    c_kv, k_pe = torch.split(attn.kv_a_proj_with_mqa(hidden), [spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    norm = getattr(attn, "kv_a_layernorm", None)
    if norm is not None:
        c_kv = norm(c_kv)
    if spec.kv_scale != 1.0:
        c_kv = c_kv * spec.kv_scale
    return c_kv, k_pe


def _update_plain_cache(cache, cache_style: str, layer_idx: int, c_kv, k_pe, kwargs: dict):
    """``cache.update`` with the model's own 4-D tensors, called the way this transformers version calls it.

    Returns every cached ``c_kv`` [B, S, Dc] and ``k_pe`` [B, S, Dr].
    """
    c4, p4 = c_kv[:, None], k_pe[:, None]  # [B, 1, T, Dc], [B, 1, T, Dr] as the model hands them over
    if cache_style == "cache":  # transformers >= 5.24
        c4, p4 = cache.update(c4, p4, layer_idx, kwargs=kwargs)
    else:  # transformers 5.17: update(k, v, layer_idx)
        c4, p4 = cache.update(c4, p4, layer_idx)
    return c4[:, 0], p4[:, 0]


PER_HEAD_PREFILL = os.environ.get("QUANTMLA_PREFILL_PER_HEAD", "1") != "0"  # on: measured faster (below)


def per_head_prefill(q_nope: torch.Tensor) -> bool:
    """Whether a chunk of several tokens asks the cache for per-head outputs (prefill in MHA form: ~3.4x fewer
    multiply-adds at DeepSeek widths, the far keys through torch's fused attention). CUDA only; on by default,
    ``QUANTMLA_PREFILL_PER_HEAD=0`` turns it off. H200, one layer, last 8192-query chunk
    (benchmarks/results/prefill_h200_heads_fused.md): 26-29 ms vs the latent form's 60-63 ms at 32K context; 8.9
    vs 9.0 ms (C4R4) and 14.4 vs 8.7 ms (BF16) at 4K; at 128K even (220 ms) before the far keys were chunked
    (their up-projection exceeded PER_HEAD_KEYS, so that run used score tiles)."""
    return PER_HEAD_PREFILL and q_nope.is_cuda and q_nope.shape[2] > 1


def _attend(attn, cache, cache_style, q_nope, q_pe, c_kv, k_pe, attention_mask, scale, kwargs) -> torch.Tensor:
    """The attention output ``[B, T, H * Dv]`` fp32 after storing the new tokens in ``cache`` (if any)."""
    spec: MLASpec = getattr(attn, _SPEC_ATTR)
    w_uk, w_uv = _up_projections(attn, spec)
    q_lat = absorb_query(q_nope, w_uk)  # [B, H, T, Dc] fp32
    layer = None if cache is None else get_mla_layer(cache, attn.layer_idx)
    if layer is not None:  # the cache speaks the absorbed protocol
        layer.write(c_kv, k_pe)
        mask = attention_mask_to_bool(attention_mask, layer.get_seq_length())
        if per_head_prefill(q_nope) and getattr(layer, "attends_per_head", False):
            o = layer.attend(q_lat, q_pe, scale, mask, heads=(q_nope, w_uk, w_uv))  # [B, H, T, Dv]
            return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)
        return expand_output(layer.attend(q_lat, q_pe, scale, mask), w_uv)
    if cache is not None:
        c_kv, k_pe = _update_plain_cache(cache, cache_style, attn.layer_idx, c_kv, k_pe, kwargs)
    mask = attention_mask_to_bool(attention_mask, c_kv.shape[1])
    return expand_output(absorbed_attention(q_lat, q_pe, c_kv, k_pe, scale, mask), w_uv)


def _absorbed_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Drop-in replacement for an MLA attention forward; returns ``(attn_output [B, T, D], None)``."""
    kwargs = _bind_args(self, hidden_states, args, kwargs)
    spec: MLASpec = getattr(self, _SPEC_ATTR)
    position_embeddings = kwargs.pop("position_embeddings")
    attention_mask = kwargs.pop("attention_mask", None)
    cache_style = "cache" if kwargs.get("cache") is not None else "past_key_values"
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy

    q_nope, q_pe = _queries(self, spec, hidden_states)
    c_kv, k_pe = _latent(self, spec, hidden_states)
    q_pe, k_pe = _rotate(spec, position_embeddings, q_pe, k_pe)

    scale = float(getattr(self, "scaling", spec.softmax_scale))
    out = _attend(self, cache, cache_style, q_nope, q_pe, c_kv, k_pe, attention_mask, scale, kwargs)  # [B, T, H Dv]
    return self.o_proj(out.to(hidden_states.dtype)), None


def _up_projections(attn: nn.Module, spec: MLASpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK`` [H, Dn, Dc] and ``W_UV`` [H, Dv, Dc]: views of the module's current ``kv_b_proj`` weight."""
    kv_b = attn.kv_b_proj.weight.view(spec.num_heads, -1, spec.kv_lora_rank)  # [H, Dn + Dv, Dc]
    return kv_b[:, : spec.qk_nope_head_dim], kv_b[:, spec.qk_nope_head_dim :]


def _rotate(spec: MLASpec, position_embeddings: Any, q_pe: torch.Tensor, k_pe: torch.Tensor):
    """Rotated ``q_pe`` [B, H, T, Dr] and ``k_pe`` [B, T, Dr], in the model's own precision and output layout.

    DeepSeek-V2 rotates in fp32 (complex multiply) and casts back; the others rotate in the activations' dtype.
    """
    cos, sin = cos_sin_from_position_embeddings(position_embeddings)  # [B, T, Dr/2]
    dtype = torch.float32 if isinstance(position_embeddings, torch.Tensor) else q_pe.dtype
    cos, sin = cos.to(dtype), sin.to(dtype)
    pairing, out_pairing = spec.rope_pairing, spec.rope_cache_pairing
    q_rot = apply_rope(q_pe.to(dtype), cos[:, None], sin[:, None], pairing, out_pairing).to(q_pe.dtype)
    k_rot = apply_rope(k_pe.to(dtype), cos, sin, pairing, out_pairing).to(k_pe.dtype)
    return q_rot, k_rot
