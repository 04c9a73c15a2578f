"""Tiny random-init fp32 MLA models of every supported transformers family, for tests and demos.

Each builds in well under a second on a CPU: 2-3 decoder blocks, hidden 64-128, a handful of experts,
kv_lora_rank 64 or 128, RoPE key 16 or 32, vocab 128. The variants cover the RoPE and query paths that
differ across families:

=================  ===============================================================================
name               what it exercises
=================  ===============================================================================
deepseek_v2        DeepSeek-V2(-Lite): no q LoRA, YaRN RoPE with mscale_all_dim, complex-multiply RoPE
deepseek_v3        DeepSeek-V3 / Kimi-K2: q LoRA, ``rope_interleave=True``
deepseek_v3_half   DeepSeek-V3 with ``rope_interleave=False`` (rotate_half), no q LoRA, YaRN
glm4_moe_lite      GLM-4.7-Flash: q LoRA, interleaved RoPE, v_head_dim != qk_nope_head_dim
longcat_flash      LongCat-Flash: two attention modules per block, LoRA scales on q and the latent
=================  ===============================================================================
"""

from __future__ import annotations

from typing import Any

import torch

TINY_MODELS = ("deepseek_v2", "deepseek_v3", "deepseek_v3_half", "glm4_moe_lite", "longcat_flash")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=8.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,  # != mscale_all_dim, so the YaRN attention factor that scales cos/sin is not 1
    mscale_all_dim=0.707,
)

_MOE = dict(moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2)

_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        num_hidden_layers=2,
        q_lora_rank=None,
        first_k_dense_replace=1,
        topk_method="greedy",
        rope_parameters=_YARN,
        **_MOE,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=2,
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=48,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=24,
        v_head_dim=20,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        rope_interleave=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        **_MOE,
    ),
    "deepseek_v3_half": dict(
        num_hidden_layers=3,
        q_lora_rank=None,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        rope_interleave=False,
        rope_parameters=_YARN,
        **_MOE,
    ),
    "glm4_moe_lite": dict(
        num_hidden_layers=2,
        q_lora_rank=32,
        qk_nope_head_dim=24,
        v_head_dim=32,
        n_group=1,
        topk_group=1,
        rope_interleave=True,
        mlp_layer_types=["dense", "sparse"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        **_MOE,
    ),
    "longcat_flash": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=96,
        expert_ffn_hidden_size=32,
        q_lora_rank=48,
        kv_lora_rank=128,
        qk_rope_head_dim=16,
        head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}

_MODEL_TYPE = {"deepseek_v3_half": "deepseek_v3"}
_DROP = {"longcat_flash": ("intermediate_size", "num_hidden_layers")}


def tiny_config(name: str = "deepseek_v2", **overrides: Any):
    """A transformers config for the tiny model ``name`` (one of ``TINY_MODELS``), with ``overrides`` applied."""
    from transformers import AutoConfig

    if name not in _OVERRIDES:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY_MODELS)}")
    kw = {**_COMMON, **_OVERRIDES[name], **overrides}
    for k in _DROP.get(name, ()):
        if k not in overrides:
            kw.pop(k, None)
    if "rope_parameters" in kw:
        kw["rope_parameters"] = dict(kw["rope_parameters"])
    config = AutoConfig.for_model(_MODEL_TYPE.get(name, name), **kw)
    config._attn_implementation = kw.get("attn_implementation", "sdpa")
    return config


def tiny_model(name: str = "deepseek_v2", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A random-init causal-LM of the tiny config ``name``, in eval mode.

    Latent RMSNorm gains and router weights are randomized too (transformers initializes norms to ones), so that
    weight-folding bugs cannot hide behind unit gains.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        _randomize(model)
    return model.eval()


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif "gate.weight" in name or "router" in name:
            p.normal_(0.0, 0.5)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.05)
        elif p.dim() >= 2:
            p.normal_(0.0, 0.1 / max(1.0, p.shape[-1] ** 0.5) * 4)
