"""A DeepSeek-V3 checkpoint as vLLM reads it: the same function, in the two conventions vLLM hard-codes.

vLLM's DeepSeek-V2/V3 model (0.32 and 0.33) differs from transformers' ``DeepseekV3ForCausalLM`` in two config
switches that a converted checkpoint (``quantmla convert --variant b``) uses:

* **RoPE pairing.** vLLM always rotates interleaved pairs ``(2i, 2i + 1)`` of the RoPE dims
  (``is_neox_style=False``) and ignores ``rope_interleave``; transformers with ``rope_interleave: false`` rotates
  pairs ``(i, i + d/2)``. Permuting the RoPE rows of the query projection (per head) and of the key's RoPE rows in
  ``kv_a_proj_with_mqa`` to ``[0, d/2, 1, d/2 + 1, ...]`` and setting ``rope_interleave: true`` makes both
  engines compute the original function: transformers de-interleaves the rows back (bit for bit the original
  model), vLLM rotates the pairs in place (its ``q_pe``/``k_pe`` are a fixed permutation of transformers', so
  every attention logit is the same sum in another order).
* **Tied embeddings.** vLLM's DeepSeek model has its own ``lm_head`` and does not tie it to the embeddings; a
  tied checkpoint has no ``lm_head.weight``. The export writes it (a copy of ``embed_tokens``) and unties.

Nothing else changes, so ``quantmla generate`` gives the same tokens on the source and on the export (tested).
The RoPE path of every QuantMLA format quantizes all ``d`` RoPE dims as one group, so a permutation of them
quantizes to the same values, permuted. A source folder's query-aware RoPE rounding (``quantmla_rope_rounding.st``)
is copied as it is: its moments are in the model's cache order (transformers de-interleaves the exported rows back,
so that order is unchanged), and the plugin renames the plans' channels to vLLM's interleaved key when it loads
them (``quantmla.serve.vllm.config.rounding_plans``).
"""

from __future__ import annotations

import json
import os
import shutil

_COPY = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
         "special_tokens_map.json", "quantmla_conversion.json")  # fmt: skip
EXPORT_VERSION = 1
_INDEX = "model.safetensors.index.json"


def interleave_permutation(d: int) -> list[int]:
    """Row order that turns the rotate-half RoPE layout into the interleaved one: new row ``2i`` = old ``i``, new
    ``2i + 1`` = old ``i + d/2``."""
    if d <= 0 or d % 2:
        raise ValueError(f"the RoPE width must be even and positive, got {d}")
    return [i // 2 + (d // 2) * (i % 2) for i in range(d)]


def _rope_rows(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """Tensor-name suffix -> (block width, offset of the RoPE rows in a block, number of blocks)."""
    nope, rope, heads = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"]
    q = "self_attn.q_b_proj" if cfg.get("q_lora_rank") else "self_attn.q_proj"
    return {q: (nope + rope, nope, heads), "self_attn.kv_a_proj_with_mqa": (cfg["kv_lora_rank"] + rope,
                                                                          cfg["kv_lora_rank"], 1)}  # fmt: skip


def vllm_ready_config(cfg: dict) -> tuple[dict, list[str]]:
    """The exported config and what the export changes (empty when the checkpoint is already as vLLM reads it)."""
    if cfg.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        raise ValueError(
            f"model_type {cfg.get('model_type')!r}: only DeepSeek-V2/V3 checkpoints are exported for vLLM "
            "(variant b of `quantmla convert` is one; variant a's quantmla_mla type is not a vLLM model)"
        )
    changes = []
    out = dict(cfg)
    if cfg.get("model_type") == "deepseek_v3" and cfg.get("rope_interleave", True) is False:
        out["rope_interleave"] = True
        changes.append("rope_interleave")
    if cfg.get("tie_word_embeddings", False):
        out["tie_word_embeddings"] = False
        changes.append("tie_word_embeddings")
    return out, changes


def export_for_vllm(src: str, out: str, *, force: bool = False) -> str:
    """Write ``src`` (a transformers DeepSeek-V2/V3 folder with safetensors weights) to ``out`` in the conventions
    vLLM's DeepSeek model reads (see the module docstring). Atomic (:func:`quantmla.artifacts.staged`); an
    existing ``out`` is replaced only with ``force``. Returns ``out``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from quantmla.artifacts import staged, write_json

    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    new_cfg, changes = vllm_ready_config(cfg)
    from quantmla.calibrate.delta import ROUNDING_FILE

    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no .safetensors weights")
    rows = _rope_rows(cfg) if "rope_interleave" in changes else {}
    perm = torch.tensor(interleave_permutation(cfg["qk_rope_head_dim"]))
    key = {"export": "vllm", "version": EXPORT_VERSION, "source": os.path.abspath(src), "changes": changes}
    with staged(out, force=force, key=key) as tmp:
        embed = None
        has_head = False
        for name in files:
            tensors = {}
            with safe_open(os.path.join(src, name), "pt") as fh:
                for k in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    t = fh.get_tensor(k)
                    for suffix, (width, off, blocks) in rows.items():
                        if k.endswith(suffix + ".weight") or k.endswith(suffix + ".bias"):
                            t = _permute_rope(t, width, off, blocks, perm)
                    if k.endswith("embed_tokens.weight"):
                        embed = t
                    has_head |= k == "lm_head.weight"
                    tensors[k] = t.contiguous()
            if name == files[-1] and "tie_word_embeddings" in changes and not has_head:
                if embed is None:
                    raise ValueError(f"{src}: tied embeddings but no embed_tokens.weight to copy into lm_head")
                tensors["lm_head.weight"] = embed.clone()
            save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
        if os.path.isfile(os.path.join(src, _INDEX)):
            _copy_index(src, tmp, files[-1] if "tie_word_embeddings" in changes and not has_head else None)
        write_json(tmp, "config.json", new_cfg)
        for name in (*_COPY, ROUNDING_FILE):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
        write_json(tmp, "quantmla_vllm_export.json", {"source": os.path.abspath(src), "changes": changes})
    return out


def _permute_rope(t, width: int, off: int, blocks: int, perm):
    """Permute the RoPE rows (first dim) of every ``width``-row block of ``t``."""
    if t.shape[0] != width * blocks:
        raise ValueError(f"expected {width * blocks} rows (blocks of {width}), got {tuple(t.shape)}")
    v = t.reshape(blocks, width, *t.shape[1:]).clone()
    v[:, off:] = v[:, off:][:, perm]
    return v.reshape(t.shape)


def _copy_index(src: str, tmp: str, head_file: str | None) -> None:
    """The sharded checkpoint's index, listing the added ``lm_head.weight`` (in ``head_file``) if there is one."""
    with open(os.path.join(src, _INDEX)) as fh:
        idx = json.load(fh)
    if head_file is not None:
        idx["weight_map"]["lm_head.weight"] = head_file
    with open(os.path.join(tmp, _INDEX), "w") as fh:
        json.dump(idx, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    """``python -m quantmla.serve.checkpoint SRC OUT [--force]``: write the vLLM export of ``SRC`` to ``OUT``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m quantmla.serve.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("src", help="a transformers DeepSeek-V2/V3 folder, e.g. `quantmla convert --variant b --healed`'s")
    p.add_argument("out", help="the folder to write (an existing one only with --force)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = p.parse_args(argv)
    try:
        out = export_for_vllm(args.src, args.out, force=args.force)
    except (OSError, ValueError) as e:
        p.exit(2, f"error: {e}\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
