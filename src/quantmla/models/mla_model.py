"""``quantmla_mla``: DeepSeek-V3 multi-head latent attention with two switches, registered with transformers.

This is the model class of the GQA->MLA conversions that ``quantmla convert`` writes (see
:mod:`quantmla.models.convert`). It *is* transformers' DeepSeek-V3 model (same module names, same weight
names, same attention forward, same ``cache.update(c_kv, k_pe)`` call), with two config fields that the
stock class does not have:

- ``latent_norm`` (bool, default True): when False, ``kv_a_layernorm`` is the identity, i.e. the cached
  content latent is the raw ``kv_a_proj_with_mqa`` output. A converted model has no trained latent norm,
  and inserting one without retraining destroys it (the latent's RMS varies across tokens).
- ``rope_frequency_dim`` (int or None, default None): the RoPE frequencies are those of a head of this
  width, tiled ``qk_rope_head_dim / rope_frequency_dim`` times, instead of those of one
  ``qk_rope_head_dim``-wide head. A 128-dim shared RoPE key built from two 64-dim Llama heads needs the
  64-dim head's 32 frequencies twice. With rotate-half pairing (``rope_interleave=False``) dimension
  ``i`` and ``i + qk_rope_head_dim / 2`` form the pair of frequency ``inv_freq[i % (rope_frequency_dim / 2)]``.
- ``q_bias`` (bool, default False): ``q_proj`` has a bias (Qwen2 sources; needs ``q_lora_rank=None``).

Every decoder layer has a dense MLP (``first_k_dense_replace`` is forced to ``num_hidden_layers``) and
there are no multi-token-prediction layers. Importing this module registers ``model_type="quantmla_mla"``
with ``AutoConfig`` and ``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_pretrained(dir)`` works
once ``quantmla.models`` has been imported.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as _dsv3

MODEL_TYPE = "quantmla_mla"


class QuantMLAConfig(DeepseekV3Config):
    """DeepSeek-V3 config plus ``latent_norm`` and ``rope_frequency_dim`` (see the module docstring)."""

    model_type = MODEL_TYPE

    def __post_init__(self, **kwargs):
        latent_norm = kwargs.pop("latent_norm", getattr(self, "latent_norm", True))
        rope_frequency_dim = kwargs.pop("rope_frequency_dim", getattr(self, "rope_frequency_dim", None))
        q_bias = kwargs.pop("q_bias", getattr(self, "q_bias", False))
        super().__post_init__(**kwargs)
        self.latent_norm = bool(latent_norm)
        self.q_bias = bool(q_bias)
        self.rope_frequency_dim = None if rope_frequency_dim is None else int(rope_frequency_dim)
        # dense MLP on every layer, no multi-token prediction
        self.first_k_dense_replace = self.num_hidden_layers
        self.num_mtp_layers = 0
        rfd = self.rope_frequency_dim
        if rfd is not None and (rfd <= 0 or rfd % 2 or self.qk_rope_head_dim % rfd):
            raise ValueError(
                f"rope_frequency_dim={rfd} must be a positive even divisor of qk_rope_head_dim={self.qk_rope_head_dim}"
            )


def rope_inv_freq(config) -> torch.Tensor:
    """Inverse RoPE frequencies [qk_rope_head_dim / 2] (fp32) of a ``quantmla_mla`` config (tiled, see above)."""
    base = float(config.rope_parameters["rope_theta"])
    dim = getattr(config, "rope_frequency_dim", None) or config.qk_rope_head_dim
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [dim / 2]
    return inv.repeat(config.qk_rope_head_dim // dim)  # [qk_rope_head_dim / 2]


class QuantMLARotaryEmbedding(_dsv3.DeepseekV3RotaryEmbedding):
    """DeepSeek-V3 rotary embedding whose default frequencies are tiled per ``rope_frequency_dim``."""

    def __init__(self, config):
        if config.rope_parameters.get("rope_type", "default") != "default" and getattr(config, "rope_frequency_dim", 0):
            raise ValueError("quantmla_mla: rope_frequency_dim is only supported with rope_type 'default'")
        super().__init__(config)

    @staticmethod
    def compute_default_rope_parameters(config, device=None, *args, **kwargs) -> tuple[torch.Tensor, float]:
        inv = rope_inv_freq(config)
        return (inv if device is None else inv.to(device)), 1.0


class QuantMLAPreTrainedModel(_dsv3.DeepseekV3PreTrainedModel):
    config_class = QuantMLAConfig
    config: QuantMLAConfig


def _patch(model: nn.Module, config: QuantMLAConfig) -> None:
    """Swap in the switched-off latent norm and the tiled rotary embedding after the stock constructor."""
    if not getattr(config, "latent_norm", True):
        for layer in model.layers:
            layer.self_attn.kv_a_layernorm = nn.Identity()
    if getattr(config, "q_bias", False):
        if config.q_lora_rank is not None:
            raise ValueError("quantmla_mla: q_bias needs q_lora_rank=None")
        for layer in model.layers:
            old = layer.self_attn.q_proj
            layer.self_attn.q_proj = nn.Linear(old.in_features, old.out_features, bias=True)
    model.rotary_emb = QuantMLARotaryEmbedding(config)


class QuantMLAModel(QuantMLAPreTrainedModel, _dsv3.DeepseekV3Model):
    def __init__(self, config: QuantMLAConfig):
        _dsv3.DeepseekV3Model.__init__(self, config)
        _patch(self, config)


class QuantMLAForCausalLM(QuantMLAPreTrainedModel, _dsv3.DeepseekV3ForCausalLM):
    def __init__(self, config: QuantMLAConfig):
        _dsv3.DeepseekV3ForCausalLM.__init__(self, config)
        _patch(self.model, config)


def register() -> None:
    """Register ``quantmla_mla`` with AutoConfig / AutoModelForCausalLM (idempotent)."""
    try:
        AutoConfig.register(MODEL_TYPE, QuantMLAConfig)
    except ValueError:
        pass  # already registered
    try:
        AutoModelForCausalLM.register(QuantMLAConfig, QuantMLAForCausalLM)
    except ValueError:
        pass


register()
