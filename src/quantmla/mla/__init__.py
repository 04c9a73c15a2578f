"""Model-agnostic MLA math: the spec read from a transformers config, RoPE variants, weights, and the
exact absorbed-attention reference (fp32)."""
