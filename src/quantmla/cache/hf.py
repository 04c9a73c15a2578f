"""``QuantMLACache``: a transformers ``Cache`` that stores MLA latents in a dual-path low-bit format.

Pass it as ``past_key_values`` to ``model.generate`` (or a forward call) of any supported MLA model::

    cache = QuantMLACache(model.config, "c4r4")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    print(cache.memory_report())

Two ways attention reads it:

* **compatible path** (any transformers MLA attention): the model calls ``cache.update(c_kv, k_pe)``;
  the cache writes the new tokens (packed copy + full-precision sink/local copies) and returns the
  whole latent as the newest token sees it, which the model re-expands through ``kv_b_proj`` as usual;
* **absorbed path** (:func:`quantmla.mla.attention.enable_absorbed_attention`): attention calls
  ``cache.mla_layer(i).write(...)`` and ``.attend(...)`` in latent space, with the per-query policy,
  never re-expanding the cached latents.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from quantmla.cache.dual_path import DualPathLayer
from quantmla.mla.spec import MLASpec
from quantmla.quant.formats import CacheFormat, CachePolicy, cache_bytes, get_format


class DualPathCacheLayer(CacheLayerMixin):
    """transformers cache layer wrapping one :class:`DualPathLayer`."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, fmt: CacheFormat, policy: CachePolicy):
        super().__init__()
        self.mla = DualPathLayer(fmt, policy)

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
        return self.mla.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.mla = DualPathLayer(self.mla.fmt, self.mla.policy)
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.mla.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.mla.select_batch(indices)

    def offload(self):  # the packed store is small; keep it where it is
        pass

    def prefetch(self):
        pass


class QuantMLACache(Cache):
    """Dual-path low-bit MLA cache for a transformers model.

    config: the model's config (or an :class:`MLASpec`); fmt: a format name (``"c4r4"``) or
    :class:`CacheFormat`; policy: sink/local sizes (default sink 4, local 128).
    """

    def __init__(self, config: Any, fmt: str | CacheFormat = "c4r4", policy: CachePolicy | None = None):
        self.spec = config if isinstance(config, MLASpec) else MLASpec.from_config(config)
        self.fmt = get_format(fmt).adapted(self.spec.kv_lora_rank, self.spec.qk_rope_head_dim)
        self.fmt.check_dims(self.spec.kv_lora_rank, self.spec.qk_rope_head_dim)
        self.policy = policy or CachePolicy()
        layers = [DualPathCacheLayer(self.fmt, self.policy) for _ in range(self.spec.num_cache_layers)]
        super().__init__(layers=layers)

    def _layer(self, layer_idx: int) -> DualPathCacheLayer:
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer {layer_idx} out of range: this cache has {len(self.layers)} layers")
        return self.layers[layer_idx]

    def mla_layer(self, layer_idx: int) -> DualPathLayer:
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

    def memory_bytes(self) -> int:
        """Bytes actually allocated by the cache's tensors right now."""
        return sum(layer.mla.nbytes() for layer in self.layers)

    def memory_report(self) -> dict:
        """Stored tokens, allocated bytes, and the physical bytes of the same cache on a BF16 model (formula)."""
        s = self.get_seq_length()
        b = self.layers[0].mla.batch or 0
        kw = dict(
            kv_lora_rank=self.spec.kv_lora_rank,
            rope_dim=self.spec.qk_rope_head_dim,
            num_layers=self.spec.num_cache_layers,
            context=s,
            batch=b,
            policy=self.policy,
        )
        phys = cache_bytes(self.fmt, **kw).total
        bf16 = cache_bytes("bf16", **kw).total
        return {
            "format": self.fmt.name,
            "tokens": s,
            "batch": b,
            "layers": self.spec.num_cache_layers,
            "allocated_bytes": self.memory_bytes(),
            "physical_bytes_bf16_model": phys,
            "bf16_cache_bytes": bf16,
            "compression_vs_bf16": (bf16 / phys) if phys else float("nan"),
        }
