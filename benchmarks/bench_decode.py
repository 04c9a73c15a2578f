"""Decode-attention benchmark on one GPU: packed formats vs our BF16 kernel vs plain PyTorch.

DeepSeek-V2-Lite attention shapes (16 heads, latent 512, RoPE 64), page 64, sink 4 / local 128, shuffled
block tables. For every (batch, context) the script first checks each kernel against the fp32 torch
reference (relative L2 error, cosine, LSE), then times it: the decode call (split-K kernel + combine) is
captured in a CUDA graph and each replay is timed with CUDA events after the L2 cache has been flushed
(256 MB memset outside the timed region); the median over ``--reps`` replays is reported.

Decode attention is memory-bound: the floor is (bytes of the cache it must read) / (copy bandwidth).
"effective bytes" counts exactly those bytes (packed pages of the packed range, BF16 sink/local slots,
BF16 pages for the BF16 kernel and for PyTorch); GB/s = effective bytes / median time, reported beside
the device-to-device copy bandwidth measured in the same run (bytes read + written / time).

"torch" is a plain PyTorch absorbed implementation over a dense contiguous BF16 cache [B, N, 576]:
``softmax(q . K^T * scale) @ K[..., :512]`` with bf16 matmuls and an fp32 softmax.

Writes ``decode_<tag>.json``, ``decode_<tag>.md`` and ``decode_<tag>.png`` to ``--out`` and prints one JSON
line last. Usage (on the GPU machine)::

    PYTHONPATH=src python benchmarks/bench_decode.py --out benchmarks/results

``--variants base,splitd,splitd:num_stages=3`` instead times the packed-page kernel variants side by side (each
checked against the fp32 reference and the base kernel first) at four shapes and writes
``decode_variants_<tag>.{json,md}``; a variant ``splitd:key=value/key=value`` overrides ``TUNING_SPLITD``::

    PYTHONPATH=src python benchmarks/bench_decode.py --variants base,splitd,splitd:num_stages=3 --reps 10 --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from quantmla.kernels import triton_decode
from quantmla.kernels.paged import PagedMLACache
from quantmla.kernels.reference import decode_attention_torch
from quantmla.kernels.triton_decode import decode_attention_triton
from quantmla.quant.formats import CachePolicy

H, DC, DR = 16, 512, 64
SCALE = 192**-0.5
POLICY = CachePolicy(sink=4, local=128, page_size=64)
FORMATS = ["bf16", "c8r8", "c4r8", "c4r4", "c2r4"]
# FlashMLA BF16 dense decode on this H200 (from the issue): (batch, context) -> microseconds
FLASHMLA_US = {(32, 32768): 326.0, (32, 131072): 1170.0, (8, 131072): 330.0, (1, 131072): 102.0}
TARGET_US = {("c4r4", 32, 32768): 109.0, ("c4r4", 32, 131072): 390.0}


def log(*a) -> None:
    print(*a, flush=True)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), median of 20."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a.random_()
    b = torch.empty_like(a)
    ts = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(ts[5:]) / 1e9


class Timer:
    """Times a CUDA graph replay with events after flushing L2; median in microseconds."""

    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, reps: int) -> float:
        fn()  # compile / warm up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        ts = []
        for _ in range(reps):
            self.flush.zero_()
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            g.replay()
            en.record()
            ts.append((st, en))
        torch.cuda.synchronize()
        return statistics.median(st.elapsed_time(en) for st, en in ts) * 1e3


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative L2 error, cosine and max abs error; NaN/inf must sit in the same places."""
    same_nonfinite = bool(torch.equal(~torch.isfinite(out), ~torch.isfinite(ref)))
    o, r = out.double().flatten(), ref.double().flatten()
    fin = torch.isfinite(r) & torch.isfinite(o)
    o, r = o[fin], r[fin]
    rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item() if r.numel() else 1.0
    return {
        "rel": rel,
        "cos": cos,
        "max_abs": (o - r).abs().max().item() if r.numel() else 0.0,
        "nonfinite_ok": same_nonfinite,
    }


def check_ok(m: dict, lse: dict) -> bool:
    return m["nonfinite_ok"] and m["rel"] < 1e-2 and m["cos"] > 0.9999 and lse["max_abs"] < 2e-2


def build_cache(fmt: str, kv: torch.Tensor, lens: list[int], seed: int, device: str = "cuda") -> PagedMLACache:
    """Cache of ``fmt`` holding ``kv [B, N, 576]`` rows (sequence b: its first lens[b]); shuffled pages,
    NaN in every unwritten byte; written by the fused Triton writer in chunks."""
    B, N, _ = kv.shape
    pages = sum(math.ceil(n / POLICY.page_size) for n in lens) + 8
    cache = PagedMLACache(
        fmt, B, N, policy=POLICY, num_pages=pages, device=device, shuffle=True, seed=seed, fill_byte=0xFF,
        pad_page=pages - 1,
    )  # fmt: skip
    chunk = 16384
    for t0 in range(0, N, chunk):
        t1 = min(N, t0 + chunk)
        n_new = [max(0, min(n, t1) - t0) for n in lens]
        cache.write(kv[:, t0:t1, :DC], kv[:, t0:t1, DC:], n_new, impl="triton")
    return cache


def torch_absorbed(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch absorbed MLA decode over a dense bf16 cache: q [B, H, 576], kv [B, N, 576]."""
    s = torch.matmul(q, kv.transpose(1, 2)).float() * SCALE  # [B, H, N]
    p = torch.softmax(s, dim=-1).to(kv.dtype)
    return torch.matmul(p, kv[..., :DC]).float()  # [B, H, 512]


def effective_bytes(cache: PagedMLACache) -> int:
    total = 0
    for n in cache.lengths():
        packed = len(cache.packed_range(n))
        sink, local = cache.bf16_positions(n)
        total += packed * cache.layout.bytes_per_token() + (len(sink) + len(local)) * cache.layout.bf16_slot_bytes
    return int(total)


def gpu_checks(results: list) -> bool:
    """Correctness of writer (bit-exact) and decode (vs fp32 reference) for every format, small and large."""
    ok_all = True
    torch.manual_seed(0)
    cases = [
        ("small", [0, 1, 17, 127, 128, 129, 4097], 16),
        ("odd-heads", [5, 133, 1000], 7),
        ("large", [33000, 1, 70000, 20000], 16),
    ]
    for name, lens, heads in cases:
        B, N = len(lens), max(lens)
        kv = torch.randn(B, N, DC + DR, device="cuda").bfloat16()
        kv[..., :DC] *= torch.linspace(0.2, 3.0, DC, device="cuda").bfloat16()  # uneven channel ranges
        q_lat = torch.randn(B, heads, DC, device="cuda").bfloat16()
        q_pe = torch.randn(B, heads, DR, device="cuda").bfloat16()
        for fmt in FORMATS:
            c = build_cache(fmt, kv, lens, seed=1)
            exact = True
            if name != "large":  # the torch writer on the CPU is the definition (see the report on CUDA division)
                ref_cache = PagedMLACache(
                    fmt, B, N, policy=POLICY, num_pages=c.num_pages, device="cpu", shuffle=True, seed=1,
                    fill_byte=0xFF, pad_page=c.num_pages - 1,
                )  # fmt: skip
                kv_cpu = kv.cpu()
                ref_cache.write_reference(kv_cpu[..., :DC], kv_cpu[..., DC:], lens)
                exact = bool(torch.equal(c.pool.cpu(), ref_cache.pool)) and bool(
                    torch.equal(c.local.cpu().view(torch.int16), ref_cache.local.view(torch.int16))
                    and torch.equal(c.sink.cpu().view(torch.int16), ref_cache.sink.view(torch.int16))
                )
                if fmt != "bf16":  # how the CUDA torch writer compares (PyTorch divides by a scalar as x * (1/s))
                    gpu_ref = PagedMLACache(
                        fmt, B, N, policy=POLICY, num_pages=c.num_pages, device="cuda", shuffle=True, seed=1,
                        fill_byte=0xFF, pad_page=c.num_pages - 1,
                    )  # fmt: skip
                    gpu_ref.write_reference(kv[..., :DC], kv[..., DC:], lens)
                    diff = int((gpu_ref.pool.cpu() != ref_cache.pool).sum())
                    log(f"  {fmt}: torch writer CUDA vs CPU differing pool bytes: {diff}")
                    del gpu_ref
            ref, ref_lse = decode_attention_torch(q_lat, q_pe, c, SCALE, return_lse=True)
            for splits in (None, 3):
                out, lse = decode_attention_triton(q_lat, q_pe, c, SCALE, return_lse=True, num_splits=splits)
                m = compare(out, ref)
                ml = compare(lse, ref_lse)
                ok = check_ok(m, ml) and exact
                ok_all &= ok
                results.append({"case": name, "format": fmt, "splits": splits, "writer_bit_exact": exact, **m,
                                "lse_max_abs": ml["max_abs"], "ok": ok})  # fmt: skip
                log(f"check {name:9s} {fmt:5s} splits={splits!s:4s} writer_exact={exact} rel={m['rel']:.2e} "
                    f"cos={m['cos']:.6f} lse={ml['max_abs']:.1e} {'OK' if ok else 'FAIL'}")  # fmt: skip
            del c
        del kv
    return ok_all


def bench_config(B: int, N: int, formats: list[str], timer: Timer, reps: int, with_torch: bool) -> list[dict]:
    torch.manual_seed(B * 7919 + N)
    kv = torch.randn(B, N, DC + DR, device="cuda", dtype=torch.bfloat16)
    q_lat = torch.randn(B, H, DC, device="cuda").bfloat16()
    q_pe = torch.randn(B, H, DR, device="cuda").bfloat16()
    rows = []
    lens = [N] * B
    for fmt in formats:
        c = build_cache(fmt, kv, lens, seed=B + N)
        # check first (reference over the first and last sequence only for big batches)
        out, lse = decode_attention_triton(q_lat, q_pe, c, SCALE, return_lse=True)
        ref, ref_lse = decode_attention_torch(q_lat, q_pe, c, SCALE, return_lse=True)
        m, ml = compare(out, ref), compare(lse, ref_lse)
        ok = check_ok(m, ml)
        us = timer(lambda c=c: decode_attention_triton(q_lat, q_pe, c, SCALE), reps)
        eb = effective_bytes(c)
        rows.append({"batch": B, "context": N, "impl": fmt, "us": us, "bytes": eb, "gbps": eb / us / 1e3,
                     "rel": m["rel"], "cos": m["cos"], "ok": ok})  # fmt: skip
        log(f"B={B:3d} N={N:8d} {fmt:5s} {us:9.1f} us  {eb / 1e6:9.1f} MB  {eb / us / 1e3:7.0f} GB/s  "
            f"rel={m['rel']:.1e} {'OK' if ok else 'FAIL'}")  # fmt: skip
        del c, ref, out
        torch.cuda.empty_cache()
    if with_torch:
        q = torch.cat([q_lat, q_pe], dim=-1)
        try:
            us = timer(lambda q=q, kv=kv: torch_absorbed(q, kv), reps)
            eb = B * N * (DC + DR) * 2
            rows.append({"batch": B, "context": N, "impl": "torch", "us": us, "bytes": eb, "gbps": eb / us / 1e3,
                         "rel": None, "cos": None, "ok": True})  # fmt: skip
            log(f"B={B:3d} N={N:8d} torch {us:9.1f} us  {eb / 1e6:9.1f} MB  {eb / us / 1e3:7.0f} GB/s")
        except torch.OutOfMemoryError:
            log(f"B={B} N={N} torch: out of memory, skipped")
    del kv
    torch.cuda.empty_cache()
    return rows


def tune(timer: Timer, reps: int) -> dict:
    """Try a few (warps, stages, waves, block_n) settings on C4R4 and BF16 at two shapes; keep the best sum."""
    variants = []
    for st in (1, 2, 3):
        for waves in (1.0, 2.0, 4.0):
            variants.append({"num_warps": 8, "num_stages": st, "waves": waves, "block_n": 64, "min_pages": 4})
    scores = {}
    for B, N in ((32, 32768),):
        kv = torch.randn(B, N, DC + DR, device="cuda", dtype=torch.bfloat16)
        q_lat = torch.randn(B, H, DC, device="cuda").bfloat16()
        q_pe = torch.randn(B, H, DR, device="cuda").bfloat16()
        for fmt in ("c4r4", "bf16"):
            c = build_cache(fmt, kv, [N] * B, seed=3)
            for i, v in enumerate(variants):
                (triton_decode.TUNING if fmt != "bf16" else triton_decode.TUNING_BF16).update(v)
                try:
                    us = timer(lambda c=c, a=q_lat, b=q_pe: decode_attention_triton(a, b, c, SCALE), reps)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is just skipped
                    log(f"tune {v}: {type(e).__name__}: {str(e)[:200]}")
                    us = float("inf")
                scores.setdefault((fmt, i), []).append(us)
                log(f"tune B={B} N={N} {fmt} {v} {us:.1f} us")
            del c
        del kv
        torch.cuda.empty_cache()
    best = {}
    for fmt in ("c4r4", "bf16"):
        i = min(range(len(variants)), key=lambda j: sum(scores[(fmt, j)]))
        best[fmt] = variants[i]
        log(f"tune best {fmt}: {variants[i]} {scores[(fmt, i)]}")
    return best


VARIANT_SHAPES = [(32, 32768), (32, 131072), (1, 131072), (8, 32768)]
VARIANT_FORMATS = ["bf16", "c4r4", "c2r4", "c8r8"]


def parse_variants(spec: str) -> list[tuple[str, str, dict]]:
    """``"base,splitd,splitd:maxnreg=128/num_warps=16"`` -> [(label, kernel variant, TUNING_SPLITD overrides)]."""
    out = []
    for item in spec.split(","):
        name, _, opts = item.strip().partition(":")
        over = {}
        for kv in filter(None, opts.split("/")):
            k, _, v = kv.partition("=")
            over[k] = None if v.lower() == "none" else float(v) if "." in v else int(v)
        if name not in triton_decode.VARIANTS:
            raise SystemExit(f"unknown variant {name!r} (one of {triton_decode.VARIANTS})")
        out.append((item.strip(), name, over))
    return out


def run_variant(q_lat, q_pe, cache, variant: str, over: dict, **kw):
    """decode_attention_triton with ``variant`` and TUNING_SPLITD temporarily updated by ``over``."""
    saved = dict(triton_decode.TUNING_SPLITD)
    triton_decode.TUNING_SPLITD.update(over)
    try:
        return decode_attention_triton(q_lat, q_pe, cache, SCALE, variant=variant, **kw)
    finally:
        triton_decode.TUNING_SPLITD.clear()
        triton_decode.TUNING_SPLITD.update(saved)


def bench_variants(variants, shapes, formats, timer, reps: int, rows: list[dict], device: str = "cuda") -> bool:
    """Every (shape, format): build the cache once, check each kernel variant against the fp32 reference (and the
    base kernel), then time it; appends to ``rows`` as it goes (a crash keeps what was measured). BF16 caches only
    run "base" (the variants differ in the packed-page kernel)."""
    ok_all = True
    for B, N in shapes:
        torch.manual_seed(B * 7919 + N)
        kv = torch.randn(B, N, DC + DR, device=device, dtype=torch.bfloat16)
        kv[..., :DC] *= torch.linspace(0.2, 3.0, DC, device=device).bfloat16()  # uneven channel ranges
        q_lat = torch.randn(B, H, DC, device=device).bfloat16()
        q_pe = torch.randn(B, H, DR, device=device).bfloat16()
        for fmt in formats:
            c = build_cache(fmt, kv, [N] * B, seed=B + N, device=device)
            ref, ref_lse = decode_attention_torch(q_lat, q_pe, c, SCALE, return_lse=True)
            eb = effective_bytes(c)
            base_out, base_us = None, None
            for label, name, over in variants:
                if fmt == "bf16" and name != "base":
                    continue
                row = {"batch": B, "context": N, "format": fmt, "variant": label, "bytes": eb}
                try:
                    t0 = time.time()
                    out, lse = run_variant(q_lat, q_pe, c, name, over, return_lse=True)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    first_s = time.time() - t0  # includes the Triton compile on first use
                    m, ml = compare(out, ref), compare(lse, ref_lse)
                    ok = check_ok(m, ml)
                    vs_base = compare(out, base_out)["rel"] if base_out is not None else 0.0

                    def fn(c=c, a=q_lat, b=q_pe, n=name, o=over):
                        return run_variant(a, b, c, n, o)

                    us = timer(fn, reps)
                except Exception as e:  # noqa: BLE001 - record and go on (a sticky CUDA error fails the rest too)
                    log(f"B={B} N={N} {fmt} {label}: {type(e).__name__}: {str(e)[:300]}")
                    rows.append({**row, "us": float("nan"), "gbps": float("nan"), "ok": False, "error": str(e)[:300],
                                 "rel": float("nan"), "rel_vs_base": float("nan"), "x_base": None})  # fmt: skip
                    ok_all = False
                    continue
                ok_all &= ok
                if name == "base":
                    base_out, base_us = out, us
                xb = base_us / us if base_us else None
                rows.append({**row, "us": us, "gbps": eb / us / 1e3, "rel": m["rel"], "cos": m["cos"],
                             "lse_max_abs": ml["max_abs"], "rel_vs_base": vs_base, "x_base": xb, "ok": ok,
                             "first_call_s": first_s})  # fmt: skip
                log(f"B={B:3d} N={N:7d} {fmt:5s} {label:24s} {us:9.1f} us {eb / us / 1e3:6.0f} GB/s "
                    f"x_base={xb or float('nan'):5.2f} rel={m['rel']:.1e} vs_base={vs_base:.1e} "
                    f"lse={ml['max_abs']:.1e} first={first_s:.1f}s {'OK' if ok else 'FAIL'}")  # fmt: skip
            del c, ref, base_out
            if device == "cuda":
                torch.cuda.empty_cache()
        del kv
        if device == "cuda":
            torch.cuda.empty_cache()
    return ok_all


def write_variant_outputs(out_dir: str, tag: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"decode_variants_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Decode kernel variants, {meta['device']}, {meta['date']}, commit {meta['commit']}",
        "",
        f"DeepSeek-V2-Lite shapes (H={H}, latent {DC}, RoPE {DR}), page 64, sink 4 / local 128, CUDA-graph replay "
        f"after L2 flush, median of {meta['reps']}; copy bandwidth {meta['copy_gbps']:.0f} GB/s. x base: speedup over "
        f"the base kernel of the same format. Total {meta['seconds']:.0f} s.",
        "",
        "| batch | context | format | variant | us | GB/s | x base | rel err | rel vs base | check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        xb = f"{r['x_base']:.2f}" if r.get("x_base") else ""
        lines.append(f"| {r['batch']} | {r['context']} | {r['format']} | {r['variant']} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {xb} | {r['rel']:.1e} | {r['rel_vs_base']:.1e} | "
                     f"{'ok' if r['ok'] else 'FAIL'} |")  # fmt: skip
    with open(os.path.join(out_dir, f"decode_variants_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_outputs(out_dir: str, tag: str, meta: dict, rows: list[dict], checks: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"decode_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "checks": checks}, f, indent=1)
    by = {(r["batch"], r["context"], r["impl"]): r for r in rows}
    lines = [
        f"# Decode attention, {meta['device']}, {meta['date']}, commit {meta['commit']}",
        "",
        f"DeepSeek-V2-Lite shapes (H={H}, latent {DC}, RoPE {DR}), page 64, sink 4 / local 128, shuffled block "
        f"tables, CUDA-graph replay after L2 flush, median of {meta['reps']}. Measured copy bandwidth "
        f"{meta['copy_gbps']:.0f} GB/s. Speedups: vs our BF16 kernel / vs plain PyTorch.",
        "",
        "| batch | context | impl | median us | eff. MB | GB/s | % copy BW | x BF16 | x torch | FlashMLA BF16 us "
        "| check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bf = by.get((r["batch"], r["context"], "bf16"))
        tr = by.get((r["batch"], r["context"], "torch"))
        fm = FLASHMLA_US.get((r["batch"], r["context"]))
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['impl']} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} "
            f"| {r['gbps']:.0f} | "
            f"{100 * r['gbps'] / meta['copy_gbps']:.0f}% | {bf['us'] / r['us'] if bf else float('nan'):.2f} | "
            f"{tr['us'] / r['us'] if tr else float('nan'):.2f} | {fm if fm else ''} | {'ok' if r['ok'] else 'FAIL'} |"
        )
    with open(os.path.join(out_dir, f"decode_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        batches = sorted({r["batch"] for r in rows})
        fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
        for ax, B in zip(axes[0], batches):
            for impl in FORMATS + ["torch"]:
                pts = sorted((r["context"], r["us"]) for r in rows if r["batch"] == B and r["impl"] == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            fm = sorted((n, us) for (b, n), us in FLASHMLA_US.items() if b == B)
            if fm:
                ax.scatter(
                    [p[0] for p in fm], [p[1] for p in fm], marker="x", color="k", label="FlashMLA bf16", zorder=5
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("latency (us)")
            ax.set_title(f"batch {B}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"MLA decode attention, {meta['device']}")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"decode_{tag}.png"), dpi=110)
    except ImportError:
        log("matplotlib missing: no plot")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="file tag (default: device + date)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="1024,4096,16384,32768,131072")
    ap.add_argument("--million", action="store_true", help="also batch 1 x 1M tokens")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--checks-only", action="store_true")
    ap.add_argument("--tune", action="store_true", help="pick warps/stages/splits on two shapes first")
    ap.add_argument("--tuning", default=None, help="JSON dict overriding triton_decode.TUNING")
    ap.add_argument(
        "--variants",
        default=None,
        help="time packed-kernel variants side by side instead (e.g. base,splitd,splitd:maxnreg=128) at "
        "--shapes / --formats (defaults: b32x32K, b32x128K, b1x128K, b8x32K; bf16,c4r4,c2r4,c8r8)",
    )
    ap.add_argument("--shapes", default=None, help="with --variants: BxN,BxN,...")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 1
    t_start = time.time()
    dev = torch.cuda.get_device_name()
    commit = os.environ.get("QUANTMLA_COMMIT") or _git_commit()
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import triton

    copy_gbps = copy_bandwidth()
    log(f"{dev}  torch {torch.__version__}  triton {triton.__version__}  copy {copy_gbps:.0f} GB/s")
    if args.tuning:
        triton_decode.TUNING.update(json.loads(args.tuning))
        triton_decode.TUNING_BF16.update(json.loads(args.tuning))
    if args.variants:
        variants = parse_variants(args.variants)
        shapes = VARIANT_SHAPES
        if args.shapes:
            shapes = [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
        formats = VARIANT_FORMATS if args.formats == ",".join(FORMATS) else args.formats.split(",")
        rows: list[dict] = []
        try:
            ok = bench_variants(variants, shapes, formats, Timer(), args.reps, rows)
        except Exception as e:  # noqa: BLE001 - still write what was measured
            log(f"variants run aborted: {type(e).__name__}: {str(e)[:300]}")
            ok = False
        meta = {"device": dev, "date": date, "commit": commit, "torch": torch.__version__,
                "triton": triton.__version__, "copy_gbps": copy_gbps, "reps": args.reps,
                "tuning": dict(triton_decode.TUNING), "tuning_splitd": dict(triton_decode.TUNING_SPLITD),
                "variants": args.variants, "seconds": time.time() - t_start, "command": " ".join(sys.argv)}  # fmt: skip
        tag = args.tag or f"{dev.replace(' ', '_')}_{date[:10]}"
        write_variant_outputs(args.out, tag, meta, rows)
        summary = {f"{r['format']}_{r['variant']}_b{r['batch']}_n{r['context']}": round(r["us"], 1) for r in rows}
        print(json.dumps({"device": dev, "checks_ok": ok, "seconds": round(time.time() - t_start), "us": summary}))
        return 0 if ok else 1
    checks: list[dict] = []
    if not args.skip_checks:
        ok = gpu_checks(checks)
        log(f"GPU correctness checks: {'ALL OK' if ok else 'FAILURES'}")
    if args.checks_only:
        return 0 if all(c["ok"] for c in checks) else 1
    timer = Timer()
    tuned = None
    if args.tune:
        tuned = tune(timer, max(10, args.reps // 2))
        triton_decode.TUNING.update(tuned["c4r4"])
        triton_decode.TUNING_BF16.update(tuned["bf16"])
    log(f"TUNING = {triton_decode.TUNING}  TUNING_BF16 = {triton_decode.TUNING_BF16}")
    rows: list[dict] = []
    configs = [(int(b), int(n)) for b in args.batches.split(",") for n in args.contexts.split(",")]
    if args.million:
        configs.append((1, 1 << 20))
    for B, N in configs:
        rows += bench_config(B, N, args.formats.split(","), timer, args.reps, not args.no_torch)
    meta = {"device": dev, "date": date, "commit": commit, "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbps": copy_gbps, "reps": args.reps, "tuning": dict(triton_decode.TUNING),
            "tuning_bf16": dict(triton_decode.TUNING_BF16), "tuned": tuned,
            "policy": {"sink": POLICY.sink, "local": POLICY.local, "page_size": POLICY.page_size},
            "heads": H, "kv_lora_rank": DC, "rope_dim": DR, "seconds": time.time() - t_start,
            "command": " ".join(sys.argv)}  # fmt: skip
    tag = args.tag or f"{dev.replace(' ', '_')}_{date[:10]}"
    write_outputs(args.out, tag, meta, rows, checks)
    summary = {r["impl"] + f"_b{r['batch']}_n{r['context']}": round(r["us"], 1) for r in rows}
    print(json.dumps({"device": dev, "copy_gbps": round(copy_gbps), "checks_ok": all(c["ok"] for c in checks),
                      "us": summary}))  # fmt: skip
    return 0


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
