"""Per-layer MLA weights extracted from a transformers attention module, and the walk over a model's MLA layers.

``MLALayerWeights`` holds, for one attention module, every tensor the absorbed form needs, split the way the
QuantMLA transforms act on them: the query path, the rows of ``kv_a_proj_with_mqa`` that produce the content
latent and those that produce the RoPE key, the latent RMSNorm, the up-projections ``W_UK`` / ``W_UV`` taken
apart from ``kv_b_proj``, and ``o_proj``. ``load_layer_weights`` writes (possibly transformed) weights back.

Shapes (D hidden, H heads, Dc kv_lora_rank, Dr qk_rope_head_dim, Dn qk_nope_head_dim, Dv v_head_dim,
Rq q_lora_rank): see the field comments.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from quantmla.mla.spec import MLASpec, UnsupportedModelError


@dataclass(frozen=True, eq=False)
class MLALayerWeights:
    """The weights of one MLA attention module (tensors are detached copies unless ``copy=False``)."""

    w_uk: torch.Tensor  # [H, Dn, Dc]  key up-projection (latent -> per-head no-PE key)
    w_uv: torch.Tensor  # [H, Dv, Dc]  value up-projection (latent -> per-head value)
    kv_a_latent: torch.Tensor  # [Dc, D]  rows of kv_a_proj_with_mqa producing the content latent
    kv_a_rope: torch.Tensor  # [Dr, D]  rows producing the (unrotated) RoPE key
    o_proj: torch.Tensor  # [D, H * Dv]
    q_proj: torch.Tensor | None = None  # [H * (Dn + Dr), D]  when there is no query LoRA
    q_a_proj: torch.Tensor | None = None  # [Rq, D]
    q_a_bias: torch.Tensor | None = None  # [Rq]
    q_a_norm: torch.Tensor | None = None  # [Rq]  q_a_layernorm gain
    q_a_norm_eps: float | None = None
    q_b_proj: torch.Tensor | None = None  # [H * (Dn + Dr), Rq]
    kv_a_latent_bias: torch.Tensor | None = None  # [Dc]
    kv_a_rope_bias: torch.Tensor | None = None  # [Dr]
    kv_norm: torch.Tensor | None = None  # [Dc]  kv_a_layernorm gain; None when the model has no latent norm
    kv_norm_eps: float | None = None
    o_bias: torch.Tensor | None = None  # [D]

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def kv_b_proj(self) -> torch.Tensor:
        """``kv_b_proj.weight`` [H * (Dn + Dv), Dc] reassembled from ``w_uk`` and ``w_uv``."""
        return torch.cat((self.w_uk, self.w_uv), dim=1).reshape(-1, self.w_uk.shape[-1])

    @property
    def kv_a_proj_with_mqa(self) -> torch.Tensor:
        """``kv_a_proj_with_mqa.weight`` [Dc + Dr, D] reassembled."""
        return torch.cat((self.kv_a_latent, self.kv_a_rope), dim=0)

    def to(self, *args, **kwargs) -> MLALayerWeights:
        """A copy with every tensor moved / cast like ``Tensor.to``."""
        changes = {f.name: getattr(self, f.name).to(*args, **kwargs) for f in fields(self) if _is_tensor(self, f)}
        return replace(self, **changes)


def _is_tensor(w: MLALayerWeights, f) -> bool:
    return isinstance(getattr(w, f.name), torch.Tensor)


def _t(x: torch.Tensor | None, copy: bool) -> torch.Tensor | None:
    if x is None:
        return None
    x = x.detach()
    return x.clone() if copy else x


def _norm_of(module: nn.Module | None) -> tuple[torch.Tensor | None, float | None]:
    """Gain and eps of an RMSNorm submodule; (None, None) when absent or an Identity."""
    weight = getattr(module, "weight", None)
    if module is None or weight is None:
        return None, None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    return weight, float(eps)


def extract_layer_weights(attn: nn.Module, copy: bool = True) -> MLALayerWeights:
    """``MLALayerWeights`` of a transformers MLA attention module (any supported family)."""
    _check_mla_module(attn)
    heads, dn, dv = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    dc = attn.kv_lora_rank
    kv_b = attn.kv_b_proj.weight.view(heads, dn + dv, dc)  # [H, Dn + Dv, Dc]
    kv_a = attn.kv_a_proj_with_mqa
    kv_bias = kv_a.bias
    q_a = getattr(attn, "q_a_proj", None)
    q_norm, q_eps = _norm_of(getattr(attn, "q_a_layernorm", None))
    kv_norm, kv_eps = _norm_of(getattr(attn, "kv_a_layernorm", None))
    q_proj = getattr(attn, "q_proj", None)
    q_b = getattr(attn, "q_b_proj", None)
    return MLALayerWeights(
        w_uk=_t(kv_b[:, :dn], copy),
        w_uv=_t(kv_b[:, dn:], copy),
        kv_a_latent=_t(kv_a.weight[:dc], copy),
        kv_a_rope=_t(kv_a.weight[dc:], copy),
        kv_a_latent_bias=None if kv_bias is None else _t(kv_bias[:dc], copy),
        kv_a_rope_bias=None if kv_bias is None else _t(kv_bias[dc:], copy),
        kv_norm=_t(kv_norm, copy),
        kv_norm_eps=kv_eps,
        q_proj=None if q_proj is None else _t(q_proj.weight, copy),
        q_a_proj=None if q_a is None else _t(q_a.weight, copy),
        q_a_bias=None if q_a is None else _t(q_a.bias, copy),
        q_a_norm=_t(q_norm, copy),
        q_a_norm_eps=q_eps,
        q_b_proj=None if q_b is None else _t(q_b.weight, copy),
        o_proj=_t(attn.o_proj.weight, copy),
        o_bias=_t(attn.o_proj.bias, copy),
    )


@torch.no_grad()
def load_layer_weights(attn: nn.Module, w: MLALayerWeights) -> None:
    """Write ``w`` into the attention module in place (shapes must match; e.g. after folding a transform)."""
    _check_mla_module(attn)
    pairs = [
        (attn.kv_b_proj.weight, w.kv_b_proj),
        (attn.kv_a_proj_with_mqa.weight, w.kv_a_proj_with_mqa),
        (attn.o_proj.weight, w.o_proj),
        (attn.o_proj.bias, w.o_bias),
    ]
    if attn.kv_a_proj_with_mqa.bias is not None:
        pairs.append((attn.kv_a_proj_with_mqa.bias, torch.cat((w.kv_a_latent_bias, w.kv_a_rope_bias))))
    for name, value in (("q_proj", w.q_proj), ("q_a_proj", w.q_a_proj), ("q_b_proj", w.q_b_proj)):
        if getattr(attn, name, None) is not None:
            pairs.append((getattr(attn, name).weight, value))
    if getattr(attn, "q_a_proj", None) is not None:
        pairs.append((attn.q_a_proj.bias, w.q_a_bias))
    for name, value in (("q_a_layernorm", w.q_a_norm), ("kv_a_layernorm", w.kv_norm)):
        pairs.append((getattr(getattr(attn, name, None), "weight", None), value))
    for dst, src in pairs:
        _copy_into(dst, src)


def _copy_into(dst: torch.Tensor | None, src: torch.Tensor | None) -> None:
    if dst is None and src is None:
        return
    if dst is None or src is None:
        raise ValueError("MLALayerWeights does not match the module: a weight is present on one side only")
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading MLA weights: module has {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def is_mla_attention(module: nn.Module) -> bool:
    """True for a transformers MLA attention module (it has the latent down- and up-projections)."""
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "layer_idx"))


def _check_mla_module(attn: nn.Module) -> None:
    if not is_mla_attention(attn):
        raise UnsupportedModelError(
            f"{type(attn).__name__} is not an MLA attention module (needs kv_a_proj_with_mqa, kv_b_proj, o_proj)"
        )


def iter_mla_attention(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """Yield ``(cache_layer_idx, attention_module)`` for every MLA attention module, in cache-layer order.

    The cache layer index is the module's own ``layer_idx``, the index it passes to ``cache.update``. For the
    one-attention-per-block families it equals the decoder block index. LongCat-Flash has two attention modules
    per decoder block (``layers[i].self_attn[0]`` and ``[1]``) with ``layer_idx`` ``2 * i`` and ``2 * i + 1``; its
    config's ``num_hidden_layers`` is ``2 * num_layers``, so ``DynamicCache(config=...)`` holds one cache layer
    per attention module.

    Raises ``UnsupportedModelError`` for a model that is not a supported MLA model (checked on its config).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no transformers config; cannot find MLA layers")
    spec = MLASpec.from_config(config)
    found = sorted(((m.layer_idx, m) for m in model.modules() if is_mla_attention(m)), key=lambda p: p[0])
    idxs = [i for i, _ in found]
    if idxs != list(range(spec.num_cache_layers)):
        raise UnsupportedModelError(
            f"expected MLA attention modules with layer_idx 0..{spec.num_cache_layers - 1} in "
            f"{type(model).__name__}, found {idxs}"
        )
    yield from found
