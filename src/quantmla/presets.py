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
    layer_key = "num_layers" if mt == "longcat_flash" and config.get("num_layers") else "num_hidden_layers"
    if config.get(layer_key) is None and config.get("num_layers") is not None:
        layer_key = "num_layers"
    dims = {k: config.get(k) for k in ("kv_lora_rank", "qk_rope_head_dim", layer_key)}
    for k, v in dims.items():
        if v is None:
            raise UnsupportedModelError(f"config lacks the field {k!r} (the number of decoder layers)")
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"config field {k!r} must be a positive integer, got {v!r}")
    layers = dims[layer_key]
    if mt == "longcat_flash" and layer_key == "num_layers":
        layers = 2 * layers  # two attention sublayers per decoder block
    return dims["kv_lora_rank"], dims["qk_rope_head_dim"], layers
