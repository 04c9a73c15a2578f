"""The QuantMLA attention backend as vLLM sees it: name, supported shapes, the KV cache spec, start-up checks.

Imports vLLM (only loaded by vLLM, through the registry path ``quantmla.serve.vllm.backend.QuantMLABackend``).

* :meth:`QuantMLABackend.customize_spec` makes the layer's ``MLAAttentionSpec`` report quantmla's page bytes
  per block (``state_content_bytes`` = page bytes / block size), so vLLM's own planner divides its memory by
  our bytes and the scheduler's usable slots are ours.
* The start-up checks are :func:`quantmla.serve.vllm.config.check_config` (called by the impl).

The forward path (metadata builder and impl) is :mod:`quantmla.serve.vllm.impl`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

from quantmla.serve.slots import CACHE_DTYPES, ServeGeometry
from quantmla.serve.vllm.config import BACKEND_NAME, KERNEL_BLOCK_SIZES, geometry, requested_cache_dtype


class QuantMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", *CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: the latent/RoPE widths are checked at start-up (check_config)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return list(KERNEL_BLOCK_SIZES)

    @staticmethod
    def get_impl_cls():
        from quantmla.serve.vllm.impl import QuantMLAImpl

        return QuantMLAImpl

    @staticmethod
    def get_builder_cls():
        from quantmla.serve.vllm.impl import QuantMLAMetadataBuilder

        return QuantMLAMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        """Our page bytes per block for a QuantMLA format; unchanged for BF16."""
        geo = _engine_geometry()
        if geo is None:
            return super().customize_spec(spec)
        geo = replace(geo, block_size=spec.block_size)
        per_token = math.ceil(geo.block_bytes() / spec.block_size)
        return replace(spec, state_content_bytes=per_token, dtype=torch.uint8)


def _engine_geometry() -> ServeGeometry | None:
    """The geometry of the engine being configured: from the current vLLM config when one is set, else from this
    worker's QuantMLA layers (vLLM asks for the spec outside any config context); None for BF16."""
    from vllm.config import get_current_vllm_config

    from quantmla.serve.vllm.worker import all_worker_caches

    try:
        cfg = get_current_vllm_config()
    except AssertionError:  # 0.32 outside set_current_vllm_config()
        cfg = None
    if cfg is not None and cfg.model_config is not None:
        cache_dtype = requested_cache_dtype(cfg)
        return None if cache_dtype is None else geometry(cfg, cache_dtype)
    caches = all_worker_caches()
    if len(caches) != 1:
        raise RuntimeError(f"cannot tell which QuantMLA cache this KV cache spec belongs to ({len(caches)} engines)")
    return caches[0].geometry
