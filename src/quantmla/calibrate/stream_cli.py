"""``quantmla calibrate-stream`` and ``quantmla merge``: calibrate a checkpoint larger than memory into a delta,
and apply the delta.

Usage::

    quantmla calibrate-stream --model /data/DeepSeek-V3-Base --format c4r4 --out v3-c4r4.delta.safetensors \\
        --preset paper --dtype bfloat16 --device cuda [--tokens calib.pt] [--resume]
    quantmla merge --base /data/DeepSeek-V3-Base --delta v3-c4r4.delta.safetensors --out /data/DeepSeek-V3-c4r4

Calibration text: ``--tokens FILE`` (a ``torch.save``-d integer tensor [N, T], e.g. WikiText-2 tokenized with the
model's own tokenizer elsewhere) or the model directory's tokenizer on ``--corpus`` (quantmla.data.corpus).
An interrupted run continues with ``--resume`` (same arguments); ``--force`` starts over / overwrites ``--out``.
``--rope-rotation`` (hadamard, default, or none) is ``quantmla calibrate``'s: the delta carries the rotation beside
the query moments and ``merge`` writes both into the merged folder's rounding file.
"""

from __future__ import annotations

import json

DTYPES = ("bfloat16", "float16", "float32")


def add_stream_args(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate-stream",
        help="calibrate a sharded (FP8 block-scaled) checkpoint one decoder block at a time into a delta",
        description="Streamed QuantMLA calibration: one decoder block in memory at a time, FP8 weights dequantized "
        "on load, only the folded attention projections written (a delta checkpoint; apply with `quantmla merge`).",
    )
    p.add_argument("--model", required=True, help="local checkpoint directory (safetensors shards + index)")
    p.add_argument("--format", default="c4r4", help="cache format: c4r4 (default), c2r4, ...")
    p.add_argument("--out", required=True, help="the delta file to write (.safetensors)")
    p.add_argument("--work", default=None, help="progress directory (default: OUT.work)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its progress directory")
    p.add_argument("--force", action="store_true", help="overwrite --out and discard earlier progress")
    p.add_argument("--keep-work", action="store_true", help="keep the progress directory after success")
    p.add_argument("--tokens", default=None, help="calibration token ids: a torch.save-d integer tensor [N, T]")
    p.add_argument("--corpus", default=None, help="else: text corpus tokenized with the model's tokenizer")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="dtype the blocks are materialized in (default bfloat16)")
    p.add_argument("--transforms", default=None, help="also write the learned transforms (a small file, see docs)")
    p.add_argument("--report", default=None, help="also write the per-block costs and per-layer report (JSON)")
    from quantmla.calibrate.cli import add_calibration_flags, add_rope_rotation_flag  # as `quantmla calibrate`

    p.add_argument("--preset", default=None, help="paper (default) or cpu-fast (reduced budget for small models)")
    p.add_argument("--config", default=None, help="JSON file of CalibrationConfig fields (flags below override)")
    p.add_argument("--method", default=None, help="quantmla (default), rtn, smoothquant, quarot")
    add_calibration_flags(p)
    add_rope_rotation_flag(p)  # stored beside the query moments in --transforms and the delta (and so by `merge`)
    p.add_argument("--no-progress", action="store_true", help="no per-block progress lines")
    p.set_defaults(func=run_stream)

    m = subparsers.add_parser(
        "merge",
        help="apply a QuantMLA delta to its base checkpoint (writes a complete checkpoint, shard by shard)",
        description="Write BASE with the delta's tensors substituted to OUT (one shard in memory at a time). Refuses "
        "a delta calibrated on another model.",
    )
    m.add_argument("--base", required=True, help="the checkpoint the delta was calibrated on")
    m.add_argument("--delta", required=True, help="a delta from `quantmla calibrate-stream`")
    m.add_argument("--out", required=True, help="output checkpoint directory")
    m.add_argument("--force", action="store_true", help="replace an existing --out")
    m.set_defaults(func=run_merge)


def _tokens(args, config):
    import torch

    from quantmla.cli_support import UsageError

    if args.tokens:
        t = torch.load(args.tokens, weights_only=True)
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"--tokens {args.tokens!r} must hold one integer tensor [N, T] (torch.save)")
        return t
    from transformers import AutoTokenizer

    from quantmla.calibrate.cli import calibration_tokens

    try:
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"no usable tokenizer in {args.model} ({str(e).splitlines()[0]}); pass --tokens FILE") from e
    return calibration_tokens(tok, config, args.corpus)


def run_stream(args) -> int:
    import torch

    from quantmla.calibrate.cli import config_from_args
    from quantmla.calibrate.stream import calibrate_streamed
    from quantmla.cli_support import check_output, usage_errors
    from quantmla.eval.harness import write_result

    with usage_errors():
        config = config_from_args(args)
    check_output(args.out, force=args.force)
    if args.report:
        check_output(args.report, flag="--report", force=args.force)
    if args.transforms:
        check_output(args.transforms, flag="--transforms", force=args.force)
    tokens = _tokens(args, config)
    rep = calibrate_streamed(args.model, args.format, tokens, config, args.out, work=args.work,
                             dtype=getattr(torch, args.dtype), resume=args.resume, force=args.force,
                             keep_work=args.keep_work, transforms_out=args.transforms,
                             rope_rotation=args.rope_rotation)  # fmt: skip
    if args.report:
        write_result(rep.to_dict(), args.report, force=args.force)
    print(args.out)
    print(json.dumps({"blocks": len(rep.blocks) - rep.resumed_blocks, "resumed_blocks": rep.resumed_blocks,
                      "seconds": round(rep.seconds, 1),
                      "block_bytes_max": rep.block_bytes_max, "bank_bytes": rep.bank_bytes}))  # fmt: skip
    return 0


def run_merge(args) -> int:
    from quantmla.calibrate.delta import merge_checkpoint
    from quantmla.cli_support import check_output

    check_output(args.out, kind="dir", force=args.force)
    print(merge_checkpoint(args.base, args.delta, args.out, force=args.force))
    return 0
