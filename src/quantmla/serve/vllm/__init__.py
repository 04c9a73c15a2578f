"""The vLLM plugin: QuantMLA cache dtypes and an MLA attention backend over our paged packed cache.

vLLM finds it through the ``vllm.general_plugins`` entry point (``quantmla = quantmla.serve.vllm:register``)
in every process it starts. Nothing here imports vLLM until :func:`register` runs, so ``import quantmla``
stays light. See docs/serving.md.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook: register the ``quantmla_*`` cache dtypes and the QuantMLA attention backend."""
    from quantmla.serve.vllm.adapter import register_all

    register_all()
