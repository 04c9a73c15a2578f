"""MLASpec: the dimensions and RoPE variant of an MLA model, read from a transformers config.

Supported families (``model_type``): ``deepseek_v2`` (DeepSeek-V2 / V2-Lite; interleaved RoPE pairs
through complex multiplication), ``deepseek_v3`` (DeepSeek-V3 / R1 / Kimi-K2; interleaved pairs when
``rope_interleave`` else rotate-half), ``glm4_moe_lite`` (GLM-4.7-Flash), ``longcat_flash``
(LongCat-Flash: DeepSeek-V3 attention plus fixed LoRA scales on the query and the latent) and
``quantmla_mla`` (our DeepSeek-V3 variant whose latent RMSNorm can be switched off, produced by
``quantmla convert``). All of them hand the normalized latent ``c_kv`` [B, 1, T, kv_lora_rank] and the
rotated RoPE key ``k_pe`` [B, 1, T, qk_rope_head_dim] to ``cache.update``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from quantmla.mla.rope import RopeConfig

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "quantmla_mla")


class UnsupportedModelError(ValueError):
    """The model is not an MLA model quantmla knows how to handle."""


@dataclass(frozen=True)
class MLASpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_lora_rank: int  # content latent width (512 in every shipped MLA model)
    qk_rope_head_dim: int  # RoPE key width (64)
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope_pairing: str  # "interleaved" (pairs 2i, 2i+1) or "half" (pairs i, i + d/2)
    softmax_scale: float  # includes the YaRN mscale^2 correction where the model applies it
    latent_norm: bool  # kv_a_layernorm present (DeepSeek) or not (quantmla_mla without norm)
    q_scale: float = 1.0  # LongCat-Flash: mla_scale_q_lora on q_nope and q_pe
    kv_scale: float = 1.0  # LongCat-Flash: mla_scale_kv_lora on the latent (after the norm)
    attention_layers_per_block: int = 1  # LongCat-Flash has 2 attention modules per decoder block
    rope: RopeConfig | None = None  # RoPE frequencies (default / YaRN); None when unknown

    def __post_init__(self):
        if isinstance(self.rope, dict):  # MLASpec(**spec.to_dict())
            object.__setattr__(self, "rope", RopeConfig(**self.rope))

    @property
    def rope_cache_pairing(self) -> str:
        """Column layout of the *rotated* ``k_pe`` the model hands to its cache.

        DeepSeek-V2's complex multiply keeps pairs (2i, 2i+1) interleaved; the other families' RoPE
        (``apply_rotary_pos_emb_interleave`` or ``rotate_half``) writes pair i to columns (i, i + Dr/2).
        """
        return "interleaved" if self.model_type == "deepseek_v2" else "half"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_cache_layers(self) -> int:
        """Number of distinct cache layers (attention modules) in the model."""
        return self.num_layers * self.attention_layers_per_block

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, config: Any) -> MLASpec:
        """Read the spec from a transformers config object (or a plain dict of one)."""
        get = (
            (lambda k, d=None: config.get(k, d))
            if isinstance(config, dict)
            else (lambda k, d=None: getattr(config, k, d))
        )
        mt = get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mt!r} is not an MLA model quantmla supports; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}. (Llama/Qwen-style GQA models can be converted to MLA "
                "with `quantmla convert`.)"
            )
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim") if get(k) is None]
        if missing:
            raise UnsupportedModelError(f"config of model_type {mt!r} lacks MLA fields {missing}")
        nope, rope = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
        if rope % 2:
            raise UnsupportedModelError(f"qk_rope_head_dim must be even, got {rope}")
        if mt == "deepseek_v2":
            pairing = "interleaved"
        elif mt == "longcat_flash":
            pairing = "interleaved"
        else:
            pairing = "interleaved" if get("rope_interleave", True) else "half"
        scale = softmax_scale(nope + rope, _rope_parameters(get))
        latent_norm = bool(get("latent_norm", True)) if mt == "quantmla_mla" else True
        hidden = int(get("hidden_size"))
        q_lora = get("q_lora_rank")
        kv_lora = int(get("kv_lora_rank"))
        q_scale = kv_scale = 1.0
        per_block = 1
        num_blocks = get("num_hidden_layers", get("num_layers"))
        if mt == "longcat_flash":
            q_scale = (hidden / q_lora) ** 0.5
            kv_scale = (hidden / kv_lora) ** 0.5
            per_block = 2
            # LongcatFlashConfig.num_hidden_layers is 2 * num_layers (one per attention module); blocks = num_layers
            num_blocks = get("num_layers") or int(get("num_hidden_layers")) // 2
        return cls(
            model_type=mt,
            num_layers=int(num_blocks),
            hidden_size=hidden,
            num_heads=int(get("num_attention_heads")),
            kv_lora_rank=kv_lora,
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            v_head_dim=int(get("v_head_dim")),
            q_lora_rank=None if q_lora is None else int(q_lora),
            rope_pairing=pairing,
            softmax_scale=scale,
            latent_norm=latent_norm,
            q_scale=q_scale,
            kv_scale=kv_scale,
            attention_layers_per_block=per_block,
            rope=RopeConfig.from_config(config),
        )

    @classmethod
    def from_json(cls, path: str) -> MLASpec:
        import json

        with open(path) as f:
            return cls.from_config(json.load(f))


def _rope_parameters(get) -> dict:
    rp = get("rope_parameters") or get("rope_scaling") or {}
    return dict(rp) if rp else {}


def yarn_mscale(scale: float, mscale: float) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope_parameters: dict) -> float:
    """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` for YaRN (DeepSeek convention)."""
    s = qk_head_dim**-0.5
    rtype = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rtype != "default":
        mad = rope_parameters.get("mscale_all_dim")
        factor = rope_parameters.get("factor")
        if mad and factor:
            m = yarn_mscale(float(factor), float(mad))
            s = s * m * m
    return s
