"""MLA shapes of well-known models (only what the cache needs), for byte accounting without weights.

Values are from the models' public config.json files: latent width, RoPE key width and the number of
attention layers (each caches one latent + one RoPE key per token).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "deepseek-v2-lite": dict(model_type="deepseek_v2", num_hidden_layers=27, kv_lora_rank=512, qk_rope_head_dim=64),
    "deepseek-v2": dict(model_type="deepseek_v2", num_hidden_layers=60, kv_lora_rank=512, qk_rope_head_dim=64),
    "deepseek-v3": dict(model_type="deepseek_v3", num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64),
    "kimi-k2": dict(model_type="deepseek_v3", num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64),
    "glm-4.7-flash": dict(model_type="glm4_moe_lite", num_hidden_layers=47, kv_lora_rank=512, qk_rope_head_dim=64),
}


def cache_dims(config: dict) -> tuple[int, int, int]:
    """(kv_lora_rank, rope_dim, number of cache layers) from a config dict (HF config.json or a preset)."""
    from quantmla.mla.spec import SUPPORTED_MODEL_TYPES, UnsupportedModelError

    mt = config.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {mt!r} is not an MLA model quantmla supports ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for k in ("kv_lora_rank", "qk_rope_head_dim"):
        if config.get(k) is None:
            raise UnsupportedModelError(f"config lacks the MLA field {k!r}")
    layers = config.get("num_hidden_layers") or config.get("num_layers")
    if mt == "longcat_flash" and config.get("num_layers"):
        layers = 2 * int(config["num_layers"])  # two attention sublayers per decoder block
    return int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"]), int(layers)
