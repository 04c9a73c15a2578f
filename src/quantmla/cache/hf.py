"""``QuantMLACache``: a transformers ``Cache`` that stores MLA latents in the paged low-bit layout.

Pass it as the cache of ``model.generate`` (or a forward call) of any supported MLA model::

    cache = QuantMLACache(model.config, "c4r4")
    out = model.generate(ids, cache=cache, max_new_tokens=32)  # past_key_values= on transformers < 5.24
    print(cache.memory_report())

Every layer lives in one :class:`~quantmla.cache.store.PagedStore` (one block table, one pool allocation, BF16
sink/local buffers), on whatever device the model runs: on a CPU through the torch reference of the layout, on
CUDA through the fused writer and ``decode_attention(impl="auto")``. Layers may use different formats: pass a
list with one format per cache layer (or a plan object with a ``formats`` attribute).

Two ways attention reads it:

* **compatible path** (any transformers MLA attention): the model calls ``cache.update(c_kv, k_pe)``; the cache
  stores the new tokens and returns the whole latent as the newest token sees it (dequantized into a transient
  tensor, never kept), which the model re-expands through ``kv_b_proj`` as usual;
* **absorbed path** (:func:`quantmla.mla.attention.enable_absorbed_attention`, the fast one on a GPU):
  attention calls ``cache.mla_layer(i).write(...)`` and ``.attend(...)`` in latent space, with the per-query
  policy and the kernels, never re-expanding the cached latents. Left-padded batches of prompts of different
  lengths are stored without their padding here (see :mod:`quantmla.cache.layer`).

Capacity: ``max_length`` (tokens per sequence) preallocates the pages at the first write and makes a longer
sequence a clear error; without it the cache grows on demand. The BF16 buffers never hold more slots than the
cache can hold tokens, and a sink or local window longer than the model's context is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from quantmla.cache.layer import PagedCacheLayer
from quantmla.cache.store import PagedStore
from quantmla.mla.spec import MLASpec
from quantmla.quant.formats import CacheFormat, CachePolicy, cache_bytes, get_format


def layer_formats(fmt: Any, num_layers: int, kv_lora_rank: int, rope_dim: int) -> list[CacheFormat]:
    """One :class:`CacheFormat` per cache layer, adapted to the model's widths and checked.

    ``fmt``: a format name or :class:`CacheFormat` (every layer), a sequence of them (one per layer), or an object
    with a ``formats`` attribute holding such a sequence (a per-layer bit allocation plan)."""
    if hasattr(fmt, "formats") and not isinstance(fmt, (str, CacheFormat)):
        fmt = fmt.formats
    if isinstance(fmt, (str, CacheFormat)):
        fmts = [get_format(fmt)] * num_layers
    else:
        try:
            fmts = [get_format(f) for f in fmt]
        except TypeError:
            raise TypeError(
                f"fmt must be a format name, a CacheFormat, or one per layer; got {type(fmt).__name__}"
            ) from None
        if len(fmts) != num_layers:
            raise ValueError(f"got {len(fmts)} per-layer formats for a model with {num_layers} cache layers")
    out = []
    for i, f in enumerate(fmts):
        f = f.adapted(kv_lora_rank, rope_dim)
        try:
            f.check_dims(kv_lora_rank, rope_dim)
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None
        out.append(f)
    return out


class QuantMLACacheLayer(CacheLayerMixin):
    """transformers cache layer over one :class:`PagedCacheLayer` (the compatible path's ``update``)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, mla: PagedCacheLayer):
        super().__init__()
        self.mla = mla

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states = c_kv [B, 1, T, Dc], value_states = k_pe [B, 1, T, Dr] -> the whole cache, same layout."""
        if key_states.dim() != 4 or key_states.shape[1] != 1 or value_states.dim() != 4 or value_states.shape[1] != 1:
            raise ValueError(
                "QuantMLACache stores MLA latents: expected c_kv [B, 1, T, Dc] and k_pe [B, 1, T, Dr], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}. Is this an MLA model?"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.mla.write(key_states[:, 0], value_states[:, 0])
        c, r = self.mla.read()
        return c.unsqueeze(1), r.unsqueeze(1)

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.mla.get_seq_length()

    def get_max_length(self) -> int:
        return -1 if self.mla.store.max_length is None else self.mla.store.max_length

    def reset(self) -> None:  # the cache resets its store once, for all layers
        self.is_initialized = False

    def _whole_cache_only(self, *args, **kwargs):
        raise NotImplementedError(
            "QuantMLACache layers share one page table: reorder or select rows on the cache "
            "(cache.reorder_cache / cache.batch_select_indices), not on one layer"
        )

    reorder_cache = batch_select_indices = batch_repeat_interleave = _whole_cache_only

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("QuantMLACache cannot crop: tokens that left the BF16 window are gone")

    def offload(self):  # the packed store is small; keep it where it is
        pass

    def prefetch(self):
        pass


def rope_rounding_of(model) -> list | None:
    """The query-aware RoPE rounding plans a model carries, one per cache layer (None where a layer has none), or
    None when no layer has one. :func:`quantmla.calibrate.shipped.apply_transforms` attaches them (attribute
    ``ROPE_ROUNDING_ATTR`` of each attention module) from a transforms file that stores query moments."""
    from quantmla.mla.weights import iter_mla_attention
    from quantmla.quant.rounding import ROPE_ROUNDING_ATTR

    plans = [getattr(attn, ROPE_ROUNDING_ATTR, None) for _, attn in iter_mla_attention(model)]
    return plans if any(p is not None for p in plans) else None


class QuantMLACache(Cache):
    """Paged low-bit MLA cache for a transformers model.

    config: the model's config (or an :class:`MLASpec`); fmt: a format name (``"c4r4"``), a
    :class:`CacheFormat`, one per cache layer, or a plan with a ``formats`` attribute; policy: sink/local sizes
    and page size (default sink 4, local 128, page 64); max_length: fixed capacity in tokens per sequence
    (default: grow on demand); rope_rounding: one :class:`~quantmla.quant.rounding.RopeRounding` (or None) per
    cache layer -- the query-aware rounding of the RoPE key that calibrated transforms carry
    (:func:`rope_rounding_of` reads it from a model they were folded into); None: round to nearest.
    """

    def __init__(
        self,
        config: Any,
        fmt: Any = "c4r4",
        policy: CachePolicy | None = None,
        *,
        max_length: int | None = None,
        rope_rounding: list | None = None,
    ):
        self.spec = config if isinstance(config, MLASpec) else MLASpec.from_config(config)
        dc, dr = self.spec.kv_lora_rank, self.spec.qk_rope_head_dim
        self.formats = layer_formats(fmt, self.spec.num_cache_layers, dc, dr)
        self.fmt = self.formats[0] if all(f == self.formats[0] for f in self.formats) else None
        self.policy = policy or CachePolicy()
        if not isinstance(self.policy, CachePolicy):
            raise TypeError(f"policy must be a CachePolicy, got {type(self.policy).__name__}")
        if max_length is not None and (not isinstance(max_length, int) or max_length <= 0):
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        self._check_capacity(config)
        self.store = PagedStore(self.formats, dc, dr, self.policy, max_length=max_length, rope_rounding=rope_rounding)
        layers = [QuantMLACacheLayer(PagedCacheLayer(self.store, i)) for i in range(len(self.formats))]
        super().__init__(layers=layers)

    def _check_capacity(self, config: Any) -> None:
        """A sink or local window longer than the model's context is a mistake (``CachePolicy(sink=10**9)``): refuse
        it. Shorter windows are fine whatever ``max_length`` is: the buffers never hold more than the cache can."""
        ctx = None if isinstance(config, (MLASpec, dict)) else getattr(config, "max_position_embeddings", None)
        if not isinstance(ctx, int):
            return
        for name in ("sink", "local"):
            v = getattr(self.policy, name)
            if v > ctx:
                raise ValueError(
                    f"CachePolicy({name}={v}) keeps more tokens in BF16 than the model's context holds "
                    f"(max_position_embeddings = {ctx}); choose {name} <= {ctx}"
                )

    def _layer(self, layer_idx: int) -> QuantMLACacheLayer:
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer {layer_idx} out of range: this cache has {len(self.layers)} layers")
        return self.layers[layer_idx]

    def mla_layer(self, layer_idx: int) -> PagedCacheLayer:
        """The absorbed-form interface of layer ``layer_idx`` (see :mod:`quantmla.cache.protocol`)."""
        layer = self._layer(layer_idx)
        layer.is_initialized = True
        return layer.mla

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layer(layer_idx).get_seq_length() if self.layers else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0, *args, **kwargs) -> tuple[int, int]:
        return self._layer(layer_idx).get_mask_sizes(query_length)

    @property
    def is_compileable(self) -> bool:
        return False

    # -- rows (beam search, batch selection) ------------------------------------------------------
    def _select(self, index) -> None:
        for layer in self.layers:
            layer.mla.flush()
        if not self.store.started:
            return
        if torch.is_tensor(index) and index.dtype == torch.bool:
            index = index.nonzero()[:, 0]
        index = [int(i) for i in (index.tolist() if torch.is_tensor(index) else index)]
        self.store.select(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` in every layer (repeats copy pages)."""
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([b for b in range(self.store.batch) for _ in range(repeats)])

    def reset(self) -> None:
        for layer in self.layers:
            layer.mla._staged = None
            layer.reset()
        self.store.reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("QuantMLACache cannot crop: tokens that left the BF16 window are gone")

    # -- memory -----------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of every tensor the cache holds right now (pool with its spare pages, block table, lengths,
        BF16 buffers); nothing else is kept between calls."""
        return sum(t.untyped_storage().nbytes() for ts in self.store.tensors().values() for t in ts)

    def memory_report(self) -> dict:
        """Tokens, the bytes held by component, and the formula's physical bytes of the same cache (BF16 model)."""
        for layer in self.layers:
            layer.mla.flush()
        st = self.store
        s = self.get_seq_length()
        b = st.batch
        held = {k: sum(t.untyped_storage().nbytes() for t in ts) for k, ts in st.tensors().items()}
        used = st.used_pool_bytes()
        kw = dict(kv_lora_rank=self.spec.kv_lora_rank, rope_dim=self.spec.qk_rope_head_dim, num_layers=1,
                  context=s, batch=b, policy=self.policy)  # fmt: skip
        per_layer = [cache_bytes(f, **kw) for f in self.formats]
        meta = per_layer[0].metadata  # block table and lengths: once for the whole cache
        phys = sum(c.total - c.metadata for c in per_layer) + meta
        bf16 = cache_bytes("bf16", **{**kw, "num_layers": len(self.formats)}).total
        names = [f.name for f in self.formats]
        return {
            "format": self.fmt.name if self.fmt is not None else "mixed",
            "formats": names,
            "tokens": s,
            "batch": b,
            "layers": len(self.formats),
            "allocated_bytes": sum(held.values()),
            "bytes_by_component": {**held, "pool_used": used, "pool_spare": held.get("pool", 0) - used},
            "physical_bytes_bf16_model": phys,
            "bf16_cache_bytes": bf16,
            "compression_vs_bf16": (bf16 / phys) if phys else float("nan"),
        }
