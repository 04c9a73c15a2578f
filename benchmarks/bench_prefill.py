"""Chunked prefill attention over the paged cache: the split path (latent and per-head) against the previous
masked-SDPA path.

DeepSeek-V2-Lite shapes (16 heads, latent 512, RoPE 64, pages of 64 tokens, sink 4 / local 128), batch 1. For each
context ``n`` and format, one layer's cache holds ``n`` random tokens written by the fused writer in chunks of
``--chunk``; the timed call is the attention of the last chunk (``min(chunk, n)`` queries at positions ``n - chunk
.. n - 1``, reading every token through the per-query policy, the BF16 window rows from ``recent``), i.e. what one
layer does for the last chunk of an ``n``-token prompt. Every implementation is first checked against the fp32
torch reference on the same cache and queries (relative L2 <= ``REL_TOL``; the split and SDPA paths also against
each other), then timed with CUDA events (median of ``--reps`` after one warm-up; the call includes dequantizing
the packed copies into the BF16 workspace, timed alone as ``workspace``). ``mha`` is a reference point, not our
work: torch's SDPA on the shapes transformers' own DeepSeek-V2 attention runs per layer for the same chunk (per-head
q/k 192, v 128, BF16, causal lower right, no quantized cache), as in ``generate_*`` results' ``hf`` rows.

``heads`` is the split path per head (``prefill_attention_heads``: keys and values up-projected with random ``W_UK``,
``W_UV`` of V2-Lite's widths, 128 and 128; checked against its own fp32 reference, ``W_UV`` times the latent one), the
path the model takes on CUDA for chunks of several tokens. TFLOP/s count the useful causal work of absorbed
attention, ``H * sum_p (p + 1) * (576 + 512) * 2``, for every path (the per-head path does ~3.4x less).

Writes ``prefill_<tag>.{json,md}`` to ``--out`` (refuses to overwrite without ``--force``) and prints one JSON line
last. Usage::

    PYTHONPATH=src python benchmarks/bench_prefill.py --out benchmarks/results --tag h200     # on the GPU
    PYTHONPATH=src python benchmarks/bench_prefill.py --tiny --out /tmp/bench                 # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import quantmla.kernels.prefill as prefill_module
from quantmla.kernels.dispatch import prefill_attention, prefill_attention_heads
from quantmla.kernels.paged import PagedMLACache
from quantmla.quant.formats import CachePolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import gpu_tag  # noqa: E402 - the default tag: the GPU model

REL_TOL = 1e-2  # BF16 workspace and queries: ~3e-3 expected
LAYERS = 27  # DeepSeek-V2-Lite, for the per-chunk whole-model estimate
FULL = dict(dc=512, dr=64, dn=128, dv=128, heads=16, policy=CachePolicy(sink=4, local=128, page_size=64),
            scale=192**-0.5)  # fmt: skip
TINY = dict(dc=64, dr=16, dn=16, dv=16, heads=2, policy=CachePolicy(sink=4, local=8, page_size=16), scale=0.125)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def build(fmt: str, n: int, chunk: int, shape: dict, device: str, seed: int):
    """A cache with ``n`` tokens written in chunks, the ``recent`` rows of the last chunk, and its queries."""
    g = torch.Generator().manual_seed(seed)
    dc, dr, H, policy = shape["dc"], shape["dr"], shape["heads"], shape["policy"]
    cache = PagedMLACache(fmt, 1, n, kv_lora_rank=dc, rope_dim=dr, policy=policy, device=device)
    recent = None
    for t0 in range(0, n, chunk):
        T = min(chunk, n - t0)
        c = (torch.randn(1, T, dc, generator=g) * torch.linspace(0.1, 2.0, dc)).to(device, torch.bfloat16)
        k = torch.randn(1, T, dr, generator=g).to(device, torch.bfloat16)
        if t0 + T == n and cache.fmt.is_quantized:  # a BF16 cache has no window buffer: no recent rows
            recent = cache.recent_window(c, k, cache.lengths(), [T])
        cache.write(c, k, [T])
    T = n - (n - 1) // chunk * chunk  # the last chunk
    q_lat = torch.randn(1, H, T, dc, generator=g).to(device, torch.bfloat16)
    q_pe = torch.randn(1, H, T, dr, generator=g).to(device, torch.bfloat16)
    return cache, recent, q_lat, q_pe


def timed(fn, reps: int, device: str) -> float:
    """Median seconds of ``reps`` calls after one warm-up (CUDA events on the GPU)."""
    fn()
    ts = []
    for _ in range(reps):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def mha_fn(n: int, T: int, H: int, device: str, seed: int):
    """transformers' DeepSeek-V2 attention shapes for one layer and chunk (per-head q/k 192, v 128), BF16."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, T, 192, generator=g).to(device, torch.bfloat16)
    k = torch.randn(1, H, n, 192, generator=g).to(device, torch.bfloat16)
    v = torch.randn(1, H, n, 128, generator=g).to(device, torch.bfloat16)
    mask = causal_lower_right(T, n)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bench_one(fmt: str, n: int, args, shape: dict, device: str) -> list[dict]:
    cache, recent, q_lat, q_pe = build(fmt, n, args.chunk, shape, device, seed=n)
    H, T, scale = shape["heads"], q_lat.shape[2], shape["scale"]
    flops = H * (T * (n - T) + T * (T + 1) // 2) * (shape["dc"] + shape["dr"] + shape["dc"]) * 2
    base = dict(format=fmt, context=n, queries=T, heads=H)
    ref = prefill_attention(q_lat, q_pe, cache, scale, recent=recent, impl="torch")
    impls = [i for i in args.impls.split(",") if i == "split" or i == "sdpa" and n <= args.sdpa_max]
    rows, outs = [], {}
    for impl in impls:
        call = lambda impl=impl: prefill_attention(q_lat, q_pe, cache, scale, recent=recent, impl=impl)  # noqa: E731
        outs[impl] = call()
        err = rel_err(outs[impl], ref)
        ok = err <= REL_TOL
        row = dict(base, impl=impl, rel_err=err, ok=ok)
        if ok:
            s = timed(call, args.reps, device)
            row.update(ms=s * 1e3, tflops=flops / s / 1e12, model_s=s * LAYERS)
        rows.append(row)
        log(f"{fmt} n={n} {impl}: rel err {err:.2e}" + (f", {row['ms']:.2f} ms" if ok else " CHECK FAIL"))
    if "heads" in args.impls.split(","):
        g = torch.Generator().manual_seed(n + 1)
        dn, dv, dc = shape["dn"], shape["dv"], shape["dc"]
        q_nope = torch.randn(1, H, T, dn, generator=g).to(device, torch.bfloat16)
        w_uk = (torch.randn(H, dn, dc, generator=g) / dc**0.5).to(device, torch.bfloat16)
        w_uv = (torch.randn(H, dv, dc, generator=g) / dc**0.5).to(device, torch.bfloat16)
        ref_h = prefill_attention_heads(q_nope, q_pe, cache, w_uk, w_uv, scale, recent=recent, impl="torch")
        call = lambda: prefill_attention_heads(q_nope, q_pe, cache, w_uk, w_uv, scale, recent=recent,  # noqa: E731
                                               impl="split")  # fmt: skip
        err = rel_err(call(), ref_h)
        ok = err <= REL_TOL
        row = dict(base, impl="heads", rel_err=err, ok=ok)
        if ok:
            s = timed(call, args.reps, device)
            row.update(ms=s * 1e3, tflops=flops / s / 1e12, model_s=s * LAYERS)
        rows.append(row)
        log(f"{fmt} n={n} heads: rel err {err:.2e}" + (f", {row['ms']:.2f} ms" if ok else " CHECK FAIL"))
    if "split" in outs and "sdpa" in outs:
        rows.append(dict(base, impl="split_vs_sdpa", rel_err=rel_err(outs["split"], outs["sdpa"]), ok=True))
    ws = timed(lambda: cache.read_packed(0, torch.arange(n)).to(device=device, dtype=torch.bfloat16), args.reps, device)
    rows.append(dict(base, impl="workspace", ok=True, ms=ws * 1e3))
    return rows


def write_outputs(out_dir: str, tag: str, meta: dict, rows: list[dict], force: bool) -> None:
    stem = os.path.join(out_dir, f"prefill_{tag}")
    if not force and any(os.path.exists(stem + x) for x in (".json", ".md")):
        raise SystemExit(f"{stem}.json/.md exist; pass --force to overwrite or choose another --tag")
    os.makedirs(out_dir, exist_ok=True)
    impls = [i for i in ("split", "heads", "sdpa", "mha", "workspace") if any(r["impl"] == i for r in rows)]
    lines = [f"# Chunked prefill attention, one layer, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`; torch {meta['torch']}; last chunk of a prompt of `context` tokens (chunk "
             f"{meta['chunk']}), {meta['heads']} heads; median of {meta['reps']} ({meta['timer']}). Cells: ms per "
             f"layer (TFLOP/s of absorbed attention's causal work, also for `heads`, which does ~3.4x fewer FLOPs "
             f"and so can show more than the device's peak; x{LAYERS} layers = s per chunk for the whole model). "
             "`mha`: torch "
             "SDPA on transformers' per-head shapes (not our work, a reference point). `workspace`: dequantizing the "
             f"packed copies, included in split/sdpa. Every path checked first against the fp32 reference (rel L2 <= "
             f"{REL_TOL}).", "",
             "| format | context | queries | " + " | ".join(impls) + " | split rel err | split vs sdpa |",
             "|---|---|---|" + "---|" * (len(impls) + 2)]  # fmt: skip
    mha = {r["context"]: r for r in rows if r["impl"] == "mha"}
    for fmt, n in sorted({(r["format"], r["context"]) for r in rows if r["impl"] != "mha"}, key=lambda x: (x[1], x[0])):
        get = {r["impl"]: r for r in rows if (r["format"], r["context"]) == (fmt, n)}
        if n in mha:
            get["mha"] = mha[n]
        cells = []
        for i in impls:
            r = get.get(i)
            if r is None:
                cells.append("")
            elif not r["ok"]:
                cells.append(f"CHECK FAIL ({r['rel_err']:.1e})")
            else:
                extra = f" ({r['tflops']:.0f} TF/s, {r['model_s']:.2f} s)" if "tflops" in r else ""
                cells.append(f"{r['ms']:.2f}{extra}")
        errs = [f"{get[i]['rel_err']:.1e}" if i in get else "" for i in ("split", "split_vs_sdpa")]
        q = next(iter(get.values()))["queries"]
        lines.append(f"| {fmt} | {n} | {q} | " + " | ".join(cells + errs) + " |")
    from quantmla.kernels import fused_prefill

    kernels = {"fused": dict(fused_prefill._FUSED), "cudnn": dict(fused_prefill._CUDNN)}  # which kernels ran
    lines.append(f"\nFused kernels that ran (device + kind: True) or were refused (False): {json.dumps(kernels)}")
    for path, text in ((stem + ".json", json.dumps({"meta": meta, "kernels": kernels, "rows": rows}, indent=1)),
                       (stem + ".md", "\n".join(lines) + "\n")):  # fmt: skip
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def commit_id() -> str:
    commit = os.environ.get("QUANTMLA_COMMIT", "")  # the GPU machine may get a copy of the tree without .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        except OSError:
            commit = ""
    return commit.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--formats", default="bf16,c4r4")
    ap.add_argument("--impls", default="split,heads,sdpa,mha", help="of split, heads, sdpa, mha (default %(default)s)")
    ap.add_argument("--sdpa-max", type=int, default=32768, help="largest context for the slow sdpa path")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke run of this script)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="default: the GPU model that runs (h100, h200), tiny with --tiny")
    ap.add_argument("--force", action="store_true", help="overwrite existing results with this tag")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_prefill.py needs a CUDA GPU (or --tiny for the CPU smoke run)")
    shape = TINY if args.tiny else FULL
    tag = args.tag or ("tiny" if args.tiny else gpu_tag())
    stem = os.path.join(args.out, f"prefill_{tag}")
    if not args.force and any(os.path.exists(stem + x) for x in (".json", ".md")):
        raise SystemExit(f"{stem}.json/.md exist; pass --force to overwrite or choose another --tag")
    t0 = time.time()
    rows, ok = [], True
    for n in [int(v) for v in args.contexts.split(",")]:
        for fmt in args.formats.split(","):
            got = bench_one(fmt, n, args, shape, device)
            ok &= all(r["ok"] for r in got)
            rows += got
        if "mha" in args.impls.split(",") and device == "cuda":
            T = n - (n - 1) // args.chunk * args.chunk
            s = timed(mha_fn(n, T, shape["heads"], device, n), args.reps, device)
            rows.append(dict(format="-", context=n, queries=T, heads=shape["heads"], impl="mha", ok=True,
                             ms=s * 1e3, model_s=s * LAYERS))  # fmt: skip
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"), "commit": commit_id(),
            "command": " ".join(["python benchmarks/bench_prefill.py"] + (argv if argv is not None else sys.argv[1:])),
            "torch": torch.__version__, "timer": "CUDA events" if device == "cuda" else "wall clock",
            "chunk": args.chunk, "heads": shape["heads"], "reps": args.reps,
            "mm_out_dtype": prefill_module._MM_OUT_DTYPE, "seconds": round(time.time() - t0, 1),
            "all_checks_ok": ok}  # fmt: skip
    write_outputs(args.out, tag, meta, rows, args.force)
    summary = {f"{r['impl']}_{r['format']}_n{r['context']}_ms": round(r["ms"], 3) for r in rows if r.get("ms")}
    print(json.dumps({"ok": ok, **summary}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
