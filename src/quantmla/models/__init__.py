"""quantmla.models: the ``quantmla_mla`` model class (registered with transformers' Auto classes on import) and
the GQA -> MLA conversion (``quantmla convert``)."""

from quantmla.models.mla_model import MODEL_TYPE, QuantMLAConfig, QuantMLAForCausalLM, register

__all__ = ["MODEL_TYPE", "QuantMLAConfig", "QuantMLAForCausalLM", "register"]
