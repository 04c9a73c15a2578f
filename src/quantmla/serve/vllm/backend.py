"""The QuantMLA attention backend as vLLM sees it: name, supported shapes, the KV cache spec, start-up checks.

Imports vLLM (only loaded by vLLM, through the registry path ``quantmla.serve.vllm.backend.QuantMLABackend``).

* :meth:`QuantMLABackend.customize_spec` makes the layer's ``MLAAttentionSpec`` report quantmla's page bytes
  per block (``state_content_bytes`` = page bytes / block size), so vLLM's own planner divides its memory by
  our bytes and the scheduler's usable slots are ours.
* :func:`check_config` turns everything that does not fit into one error at start-up: not an MLA model, a
  latent/RoPE width or head count our kernels do not handle, a block size they do not handle, prefix caching
  on (a prefix-cache hit has no BF16 sink/local copies), decode context parallelism, a format without a
  kernel on this device.

Status: the forward path (``do_kv_cache_update`` through :class:`quantmla.serve.core.ServeLayer`, decode and
prefill through its ``decode``/``prefill``) is *not wired into vLLM's MLA layer yet*: :class:`QuantMLAImpl`
refuses at start-up, after the checks, with an error that says so (never a crash mid-serve).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend, MLACommonImpl

from quantmla.serve.slots import CACHE_DTYPES, ServeGeometry, format_of_cache_dtype
from quantmla.serve.vllm.adapter import BACKEND_NAME, requested_cache_dtype

KERNEL_BLOCK_SIZES = [16, 32, 64, 128, 256]  # the Triton decode kernel's page sizes (powers of two)


class QuantMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", *CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]  # kv_lora_rank 512 + RoPE 64: every DeepSeek-style MLA model

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return list(KERNEL_BLOCK_SIZES)

    @staticmethod
    def get_impl_cls():
        return QuantMLAImpl

    @classmethod
    def customize_spec(cls, spec):
        """Our page bytes per block for a QuantMLA format; unchanged for BF16."""
        from vllm.config import get_current_vllm_config

        cache_dtype = requested_cache_dtype(get_current_vllm_config())
        if cache_dtype is None:
            return super().customize_spec(spec)
        geo = geometry(get_current_vllm_config(), cache_dtype, spec.block_size)
        per_token = math.ceil(geo.block_bytes() / spec.block_size)
        return replace(spec, state_content_bytes=per_token, dtype=torch.uint8)


def geometry(vllm_config, cache_dtype: str, block_size: int | None = None) -> ServeGeometry:
    hf = vllm_config.model_config.hf_text_config
    return ServeGeometry(
        format_of_cache_dtype(cache_dtype),
        num_layers=vllm_config.model_config.get_num_layers(vllm_config.parallel_config),
        block_size=block_size or vllm_config.cache_config.block_size,
        kv_lora_rank=int(getattr(hf, "kv_lora_rank", 0) or 0),
        rope_dim=int(getattr(hf, "qk_rope_head_dim", 0) or 0),
    )


def check_config(vllm_config, cache_dtype: str, device: torch.device) -> list[str]:
    """Every reason this engine configuration cannot run the QuantMLA cache (empty when it can)."""
    from quantmla.kernels.dispatch import triton_available, triton_unsupported_reason

    reasons = []
    mc = vllm_config.model_config
    if not getattr(mc, "use_mla", False):
        reasons.append(f"model {mc.model!r} is not an MLA model (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash, ...)")
        return reasons
    hf = mc.hf_text_config
    dc, dr = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if (dc, dr) != (512, 64):
        reasons.append(f"latent/RoPE widths {dc}/{dr}: the QuantMLA kernels are built for 512/64")
    heads = mc.get_num_attention_heads(vllm_config.parallel_config)
    if heads <= 0:
        reasons.append(f"{heads} attention heads per rank")
    bs = vllm_config.cache_config.block_size
    if bs not in KERNEL_BLOCK_SIZES:
        reasons.append(f"block size {bs}: use one of {KERNEL_BLOCK_SIZES} (--block-size 64)")
    if vllm_config.cache_config.enable_prefix_caching:
        reasons.append("prefix caching is on: a prefix-cache hit has no BF16 sink/local copies "
                       "(--no-enable-prefix-caching)")
    if getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1:
        reasons.append("decode context parallelism shards the cache by token; not supported")
    if device.type == "cuda" and not reasons:
        geo = geometry(vllm_config, cache_dtype)
        why = triton_unsupported_reason(geo.layout.fmt, 512, 64, bs, "decode")
        if why or not triton_available():
            reasons.append(f"no decode kernel for {cache_dtype} on this GPU: {why or 'triton is not installed'}")
    return reasons


class QuantMLAImpl(MLACommonImpl):
    """Checks the configuration at start-up, then refuses: the forward path is not wired yet (see module)."""

    def __init__(self, *args, kv_cache_dtype: str | None = None, **kwargs) -> None:  # noqa: D107
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
        cache_dtype = requested_cache_dtype(cfg)
        if cache_dtype is None:
            raise ValueError(
                f"the {BACKEND_NAME} attention backend serves the QuantMLA cache dtypes {sorted(CACHE_DTYPES)}; "
                "pass --kv-cache-dtype (vLLM 0.33) or --additional-config '{\"quantmla_kv_cache_dtype\": ...}'"
            )
        reasons = check_config(cfg, cache_dtype, torch.device(cfg.device_config.device_type))
        if reasons:
            raise ValueError(f"cannot serve {cache_dtype} with this configuration: " + "; ".join(reasons))
        raise NotImplementedError(
            f"quantmla's vLLM plugin sizes the {cache_dtype} cache but its forward path (write, decode, "
            "prefill through quantmla.serve.core) is not wired into vLLM's MLA layer yet: see docs/serving.md"
        )
