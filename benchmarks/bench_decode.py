"""Decode attention on one GPU: every cache format against FlashMLA's BF16 dense decode, in one process.

DeepSeek MLA shapes (latent 512, RoPE 64), pages of 64 tokens, sink 4 / local 128, shuffled block tables, NaN in
every unwritten byte. For each (heads, batch, context): one random BF16 latent cache ``kv [B, N, 576]`` and query;
FlashMLA (``--flashmla DIR``: a FlashMLA checkout, built at run time by ``flashmla_ext.py``, never vendored) runs on
it as its own ``[pages, 64, 1, 576]`` BF16 cache, and each quantmla format on a ``PagedMLACache`` of it written by
the fused writer, through ``decode_attention(impl="auto")`` (the CUDA kernel for C4R4/C2R4 on sm_80+, Triton for
the others). Every result is checked first against the fp32 torch reference of the same bytes, computed from the
q rounding the kernel uses (relative L2 <= 5e-3, LSE |err| <= 2e-2; FlashMLA against the dense fp32 reference
of the BF16 cache), then timed: the call is captured in a CUDA graph and each replay timed with CUDA events after a
256 MB L2 flush; the median of ``--reps`` replays is reported. Copy bandwidth is measured in the same run.
``--ragged`` gives each batch lengths spread evenly from N/8 to N (a serving batch; FlashMLA gets the same lengths)
in place of N everywhere. ``--rounds R`` times every implementation of a shape R times, round-robin (FlashMLA,
then each format, again and again), and reports the median of the rounds with the spread of each speed-up over
the rounds: whether an implementation's place in the order, or the clock drifting in the call, moves a ratio.

Writes ``decode_vs_flashmla_<tag>.{json,md,png}`` to ``--out`` (rows ``{"batch", "context", "heads", "impl",
"us"}`` plus details) and prints one JSON line last. Usage (on the GPU machine)::

    PYTHONPATH=src python benchmarks/bench_decode.py --flashmla ~/FlashMLA --out benchmarks/results --tag h200
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

from quantmla.kernels.dispatch import decode_attention, resolve_impl
from quantmla.kernels.paged import PagedMLACache
from quantmla.kernels.reference import decode_attention_torch
from quantmla.quant.formats import CachePolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: results_io, flashmla_ext
from results_io import gpu_models, gpu_tag, write_results  # noqa: E402 - the one temp-file-and-rename; GPU models

DC, DR = 512, 64
SCALE = 192**-0.5
LOG2E = 1.4426950408889634
POLICY = CachePolicy(sink=4, local=128, page_size=64)
FORMATS = ["bf16", "c8r8", "c4r8", "c4r4", "c2r4", "c4r4t", "c2r4t"]
SHAPES = "32x4096,32x32768,32x131072,8x32768,8x131072,1x131072"
REL_TOL, LSE_TOL = 5e-3, 2e-2


def log(*a) -> None:
    print(*a, flush=True)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), median of 20."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ts = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return 2 * nbytes / statistics.median(ts[5:]) / 1e9


class Timer:
    """Times a CUDA graph replay with events after flushing L2; median in microseconds."""

    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, reps: int) -> float:
        fn()
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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.equal(torch.isfinite(out), torch.isfinite(ref)):
        return float("inf")
    fin = torch.isfinite(ref)
    o, r = out[fin].double(), ref[fin].double()
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item() if r.numel() else 0.0


def lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.equal(torch.isfinite(lse), torch.isfinite(ref)):
        return float("inf")
    fin = torch.isfinite(ref)
    return (lse[fin].double() - ref[fin].double()).abs().max().item() if fin.any() else 0.0


def q_as_kernel_rounds(q: torch.Tensor, impl: str) -> torch.Tensor:
    """The query the kernel effectively uses: bf16(q * scale * log2 e) for the CUDA and BF16 kernels, fp16 for the
    Triton packed kernel."""
    s = SCALE * LOG2E
    dt_ = torch.float16 if impl == "triton-packed" else torch.bfloat16
    return ((q.float() * s).to(dt_).float() / s).to(q.device)


def build_cache(fmt: str, kv: torch.Tensor, lens: list[int], seed: int) -> PagedMLACache:
    """Cache of ``fmt`` holding ``kv [B, N, 576]`` (sequence b: its first lens[b] rows); shuffled pages, NaN in every
    unwritten byte; written by the fused Triton writer in chunks."""
    B, N, _ = kv.shape
    pages = sum(math.ceil(n / POLICY.page_size) for n in lens) + 8
    cache = PagedMLACache(fmt, B, N, policy=POLICY, num_pages=pages, device="cuda", shuffle=True, seed=seed,
                          fill_byte=0xFF, pad_page=pages - 1)  # fmt: skip
    for t0 in range(0, N, 16384):
        t1 = min(N, t0 + 16384)
        cache.write(kv[:, t0:t1, :DC], kv[:, t0:t1, DC:], [max(0, min(n, t1) - t0) for n in lens], impl="triton")
    return cache


def flashmla_inputs(kv: torch.Tensor, seed: int):
    """FlashMLA's ``[pages, 64, 1, 576]`` BF16 cache of ``kv`` with a shuffled block table."""
    B, N, D = kv.shape
    per = math.ceil(N / 64)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(B * per, generator=g).to(kv.device)
    padded = torch.zeros(B, per * 64, D, dtype=kv.dtype, device=kv.device)
    padded[:, :N] = kv
    kcache = torch.empty(B * per, 64, 1, D, dtype=kv.dtype, device=kv.device)
    kcache[perm] = padded.view(B * per, 64, 1, D)
    bt = perm.view(B, per).to(torch.int32)
    return kcache, bt


def ragged_lengths(batch: int, n: int) -> list[int]:
    """``batch`` lengths spread evenly from n / 8 to n (n itself for one sequence)."""
    if batch == 1:
        return [n]
    return [round(n * (1 / 8 + 7 / 8 * b / (batch - 1))) for b in range(batch)]


def dense_reference(q: torch.Tensor, kv: torch.Tensor, lens: list[int]):
    """fp32 absorbed attention over the BF16 cache: q [B, H, 576], kv [B, N, 576] (sequence b: its first lens[b]
    rows) -> (o [B, H, 512], lse)."""
    outs, lses = [], []
    for b in range(kv.shape[0]):
        s = (q[b].float() @ kv[b, : lens[b]].float().T) * SCALE
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.softmax(s, -1) @ kv[b, : lens[b], :DC].float())
    return torch.stack(outs), torch.stack(lses)


def effective_bytes(cache: PagedMLACache) -> int:
    total = 0
    for n in cache.lengths():
        sink, local = cache.bf16_positions(n)
        total += len(cache.packed_range(n)) * cache.layout.bytes_per_token()
        total += (len(sink) + len(local)) * cache.layout.bf16_slot_bytes
    return int(total)


def parse_spec(spec: str) -> tuple[str, str, int | str | None]:
    """``FORMAT[@KERNEL][/sN|/equal]`` -> (format, CUDA kernel or "", forced split count, "equal" or None):
    ``c4r4@wgmma`` times that CUDA kernel instead of ``auto``'s choice, ``bf16/s24`` the default kernel with 24 splits
    per sequence instead of the split heuristic's (e.g. to sweep it), ``c4r4/equal`` the splits planned as if every
    sequence were the longest (the CUDA kernels' rule before ragged batches were planned for: ``--ragged``)."""
    head, sep, splits = spec.partition("/")
    fmt, _, kernel = head.partition("@")
    n: int | str | None = None
    if sep and splits == "equal":
        n = "equal"
    elif sep:
        if not (splits.startswith("s") and splits[1:].isdigit() and int(splits[1:]) > 0):
            raise ValueError(f"format spec {spec!r}: the split suffix is /sN with N a positive integer, e.g. bf16/s24, "
                             "or /equal")
        n = int(splits[1:])
    if not fmt:
        raise ValueError(f"format spec {spec!r}: no format (e.g. c4r4, c4r4@wgmma, bf16/s24)")
    return fmt, kernel, n


def cuda_plan(kind: str, q_lat, q_pe, cache, splits) -> dict:
    """``{"plan": "ns x pps", "kernel": "cuda-<kernel>"}`` of a CUDA call (splits per sequence x pages per split, the
    merge in the page kernel marked; the CUDA kernel that ran, also where ``auto`` chose it); ``{"plan": ...}`` of a
    Triton call; else nothing."""
    if kind in ("triton", "triton-packed"):
        from quantmla.kernels.triton_decode import launch_splits

        ns, pps = launch_splits(cache, q_lat.device, splits)
        return {"plan": f"{ns} x {pps}"}
    if not kind.startswith("cuda"):
        return {}
    from quantmla.kernels.cuda_decode import fused_merge, plan_decode

    kernel = kind.partition("-")[2] or None
    p = plan_decode(q_lat, q_pe, cache, SCALE, num_splits=splits, kernel=kernel)
    return {"plan": f"{p.ns} x {p.pps}" + (" fused" if fused_merge(p) else ""), "kernel": f"cuda-{p.kernel}"}


def kernel_marks(rows: list[dict]) -> dict[int, str]:
    """``{id(row): " [kernel]"}`` for the rows of a format that ran on different CUDA kernels at different shapes
    (``auto``'s choice by the size of the grid), so that the table says which cells came from which kernel."""
    by_impl: dict[str, set] = {}
    for r in rows:
        if r.get("us") is not None and str(r.get("kernel", "")).startswith("cuda-"):
            by_impl.setdefault(r["impl"], set()).add(r["kernel"])
    return {id(r): f" [{r['kernel'][5:]}]" for r in rows
            if r.get("us") is not None and len(by_impl.get(r["impl"], ())) > 1}  # fmt: skip


def bench_shape(H, B, N, formats, fm_ext, timer, reps, rows, rounds=1, ragged=False) -> bool:
    ok_all = True
    timed = []  # (row, callable) of every implementation checked and timed once: the later rounds time them again
    torch.manual_seed(H * 100003 + B * 7919 + N)
    kv = torch.randn(B, N, DC + DR, device="cuda").bfloat16()
    kv[..., :DC] *= torch.linspace(0.2, 3.0, DC, device="cuda").bfloat16()  # uneven channel ranges
    q_lat = torch.randn(B, H, DC, device="cuda").bfloat16()
    q_pe = torch.randn(B, H, DR, device="cuda").bfloat16()
    lens = ragged_lengths(B, N) if ragged else [N] * B
    base = {"batch": B, "context": N, "heads": H, **({"lens": lens} if ragged else {})}
    if fm_ext is not None:
        from flashmla_ext import FlashMLADecode

        kcache, bt = flashmla_inputs(kv, seed=N)
        q = torch.cat([q_lat, q_pe], -1).unsqueeze(1).contiguous()  # [B, 1, H, 576]
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        try:
            fm = FlashMLADecode(fm_ext, q, kcache, lens_t, bt, SCALE)
            out = fm()
            ref, ref_lse = dense_reference(q[:, 0], kv, lens)
            rel, le = rel_err(out[0][:, 0].float(), ref), lse_err(out[1][:, :, 0], ref_lse)
            us = timer(fm, reps)
            ok = rel <= 1e-2
            rows.append({**base, "impl": "flashmla-bf16", "us": us, "rel": rel, "lse_err": le, "ok": ok,
                         "bytes": sum(lens) * 1152, "kernel": "flashmla", "us_rounds": [us]})  # fmt: skip
            timed.append((rows[-1], fm))
            log(f"H={H:3d} B={B:3d} N={N:7d} flashmla-bf16 {us:9.1f} us rel={rel:.1e} {'OK' if ok else 'FAIL'}")
        except Exception as e:  # noqa: BLE001 - report and go on with our kernels
            log(f"H={H} B={B} N={N} flashmla failed: {type(e).__name__}: {str(e)[:300]}")
        if rounds == 1:
            del kcache
    for spec in formats:
        fmt, cuda_kernel, splits = parse_spec(spec)
        try:
            c = build_cache(fmt, kv, lens, seed=B + N)
            if splits == "equal":  # plan as if every sequence were the longest
                c.planned_length, splits = max(lens), None
            if cuda_kernel:
                from quantmla.kernels.cuda_decode import decode_attention_cuda

                kind = f"cuda-{cuda_kernel}"

                def run(c=c, k=cuda_kernel, n=splits, **kw):
                    return decode_attention_cuda(q_lat, q_pe, c, SCALE, kernel=k, num_splits=n, **kw)
            else:
                which = resolve_impl("auto", q_lat, c.fmt, kernel="decode", layout=c.layout, cache=c)
                kind = which if which != "triton" or fmt == "bf16" else "triton-packed"

                def run(c=c, n=splits, **kw):
                    return decode_attention(q_lat, q_pe, c, SCALE, num_splits=n, **kw)
            out, lse = run(return_lse=True)
            plan = cuda_plan(kind, q_lat, q_pe, c, splits)
            kind = plan.pop("kernel", kind)  # "cuda" -> the kernel auto chose ("cuda-wgmma", "cuda-mma", ...)
            qr_lat, qr_pe = q_as_kernel_rounds(q_lat, kind), q_as_kernel_rounds(q_pe, kind)
            ref, ref_lse = decode_attention_torch(qr_lat, qr_pe, c, SCALE, return_lse=True)
            rel, le = rel_err(out, ref), lse_err(lse, ref_lse)
            ok = rel <= REL_TOL and le <= LSE_TOL
            us = timer(run, reps)
            eb = effective_bytes(c)
            rows.append({**base, "impl": spec, "us": us, "rel": rel, "lse_err": le, "ok": ok, "bytes": eb,
                         "kernel": kind, "us_rounds": [us], **plan})  # fmt: skip
            timed.append((rows[-1], run))
            log(f"H={H:3d} B={B:3d} N={N:7d} {spec:5s} [{kind}] {us:9.1f} us {eb / us / 1e3:6.0f} GB/s "
                f"rel={rel:.1e} lse={le:.1e} {'OK' if ok else 'FAIL'} {rows[-1].get('plan', '')}")  # fmt: skip
            ok_all &= ok
            if rounds == 1:
                del c
        except Exception as e:  # noqa: BLE001 - a format that cannot run at this shape is reported, not fatal
            log(f"H={H} B={B} N={N} {spec}: {type(e).__name__}: {str(e)[:300]}")
            rows.append({**base, "impl": spec, "us": None, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        torch.cuda.empty_cache()
    for _ in range(rounds - 1):  # the same order every round: round-robin, not one implementation's reps in a block
        for row, fn in timed:
            row["us_rounds"].append(timer(fn, reps))
    summarize_rounds([row for row, _ in timed])
    if rounds > 1:
        for row, _ in timed:
            xs = " ".join(f"{x:.2f}" for x in row.get("ratio_rounds", []))
            log(f"H={H:3d} B={B:3d} N={N:7d} {row['impl']:13s} rounds: "
                + " ".join(f"{u:.1f}" for u in row["us_rounds"]) + (f"  x FlashMLA: {xs}" if xs else ""))
    return ok_all


def summarize_rounds(rows: list[dict]) -> None:
    """One shape's rows, each with ``us_rounds`` (its time in every round): ``us`` becomes the median of the rounds and
    each row but FlashMLA's gets ``ratio_rounds``, its speed-up over FlashMLA round by round (both timed in the same
    round, side by side) when there is more than one round."""
    fm_row = next((r for r in rows if r["impl"] == "flashmla-bf16"), None)
    for row in rows:
        row["us"] = statistics.median(row["us_rounds"])
        if fm_row is not None and row is not fm_row and len(row["us_rounds"]) > 1:
            row["ratio_rounds"] = [f / u for f, u in zip(fm_row["us_rounds"], row["us_rounds"], strict=True)]


def tag_device_mismatch(tag: str, device: str) -> str:
    """Empty when ``tag`` names no GPU model or the one that ran (``device``: torch's device name), else a line saying
    which (a tag is a file name: ``h200_x`` written by an H100 would pass for an H200 result)."""
    wrong = [m for m in gpu_models(tag) if m not in gpu_models(device)]
    return f"the tag names {', '.join(w.upper() for w in wrong)} but this ran on {device}" if wrong else ""


def write_outputs(out_dir: str, tag: str, meta: dict, rows: list[dict], plot: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"decode_vs_flashmla_{tag}")
    fm = {(r["heads"], r["batch"], r["context"]): r["us"] for r in rows if r["impl"] == "flashmla-bf16"}
    fmts = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "flashmla-bf16"))  # in the order run
    lines = [f"# Decode attention vs FlashMLA BF16, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`; copy bandwidth {meta['copy_gbps']:.0f} GB/s; CUDA-graph replay after an L2 flush, "
             f"median of {meta['reps']}"
             + (f", {meta['rounds']} rounds round-robin (cells: median of the rounds; speed-up: median and range of "
                "the per-round ratios)" if meta.get("rounds", 1) > 1 else "")
             + (", ragged batches (lengths spread evenly from context / 8 to context)" if meta.get("ragged") else "")
             + ". Cells: us (speed-up over FlashMLA BF16); [kernel]: the CUDA kernel auto chose, where a format's "
             "differs between shapes. All results checked first."
             + (f" **Note: {meta['tag_note']}.**" if meta.get("tag_note") else ""), "",
             "| heads | batch | context | FlashMLA BF16 us | " + " | ".join(fmts) + " |",
             "|---|---|---|---|" + "---|" * len(fmts)]  # fmt: skip
    marks = kernel_marks(rows)
    for key in sorted({(r["heads"], r["batch"], r["context"]) for r in rows}):
        cells = []
        for f in fmts:
            r = next((r for r in rows if (r["heads"], r["batch"], r["context"]) == key and r["impl"] == f), None)
            if r is None or r.get("us") is None:
                cells.append("fails" if r else "")
                continue
            ratio = f" ({fm[key] / r['us']:.2f}x)" if key in fm else ""
            if r.get("ratio_rounds"):  # the median ratio of the rounds, with its range
                x = r["ratio_rounds"]
                ratio = f" ({statistics.median(x):.2f}x, {min(x):.2f}-{max(x):.2f})"
            cells.append(f"{r['us']:.1f}{ratio}{marks.get(id(r), '')}{'' if r['ok'] else ' CHECK FAIL'}")
        fms = f"{fm[key]:.1f}" if key in fm else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {fms} | " + " | ".join(cells) + " |")
    write_results(stem, {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"})
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        heads = sorted({r["heads"] for r in rows})
        fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
        for ax, H in zip(axes[0], heads):
            for f in fmts:
                pts = sorted(
                    (r["batch"], r["context"], fm[(H, r["batch"], r["context"])] / r["us"])
                    for r in rows
                    if r["heads"] == H and r["impl"] == f and r.get("us") and (H, r["batch"], r["context"]) in fm
                )
                for B in sorted({p[0] for p in pts}):
                    xs = [p[1] for p in pts if p[0] == B]
                    ys = [p[2] for p in pts if p[0] == B]
                    ax.plot(xs, ys, marker="o", label=f"{f} B{B}")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("speed-up over FlashMLA BF16")
            ax.set_title(f"{H} heads")
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(stem + ".tmp.png", dpi=120)
        plt.close(fig)
        os.replace(stem + ".tmp.png", stem + ".png")
    except ImportError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashmla", default=None, help="FlashMLA source checkout (with csrc/cutlass), built at run time")
    ap.add_argument("--flashmla-build", default=None, help="FlashMLA build folder (default DIR/build_quantmla_bench)")
    ap.add_argument("--flashmla-prebuilt", default=None,
                    help="instead of --flashmla: the extension an earlier --flashmla run built "
                         "(<build folder>/flashmla_dense_bench.so), loaded without sources or compiler")  # fmt: skip
    ap.add_argument("--shapes", default=SHAPES, help="BxN,BxN,... (default %(default)s)")
    ap.add_argument("--heads", default="16", help="comma-separated head counts (default 16)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated; FORMAT@KERNEL times that CUDA kernel (mma, wgmma) instead of the default, "
                         "FORMAT/sN forces N splits per sequence, FORMAT/equal plans them as if every sequence "
                         "were the longest (with --ragged), e.g. c4r4,c4r4@wgmma,bf16/s34,c4r4/equal "
                         "(default %(default)s)")  # fmt: skip
    ap.add_argument("--ragged", action="store_true",
                    help="each batch's lengths spread evenly from N/8 to N instead of N (FlashMLA: the same)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation of a shape this many times, round-robin; report the median "
                         "and the spread of the speed-ups (default 1)")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="names the files (default: the GPU model, e.g. h100 or h200)")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1:
        raise SystemExit(f"--rounds and --reps must be >= 1 (got {args.rounds}, {args.reps})")
    for spec in args.formats.split(","):
        try:
            parse_spec(spec)
        except ValueError as e:
            raise SystemExit(f"--formats: {e}") from None
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU")
    t0 = time.time()
    fm_ext = None
    if args.flashmla and args.flashmla_prebuilt:
        raise SystemExit("give --flashmla DIR (build) or --flashmla-prebuilt SO (load), not both")
    if args.flashmla or args.flashmla_prebuilt:
        from flashmla_ext import load_flashmla, load_prebuilt

        tb = time.time()
        if args.flashmla_prebuilt:
            fm_ext = load_prebuilt(args.flashmla_prebuilt)
        else:
            fm_ext = load_flashmla(args.flashmla, args.flashmla_build)
        log(f"FlashMLA dense decode ready in {time.time() - tb:.0f} s")
    commit = os.environ.get("QUANTMLA_COMMIT", "")  # the GPU machine gets a copy of the tree, maybe no .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        except OSError:
            commit = "unknown"
    commit = commit.strip()
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    meta = {"device": torch.cuda.get_device_name(), "date": now, "commit": commit or "unknown",
            "command": " ".join(sys.argv), "reps": args.reps, "rounds": args.rounds, "ragged": args.ragged,
            "copy_gbps": copy_bandwidth(), "torch": torch.__version__}  # fmt: skip
    log(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s")
    if args.tag is None:  # the GPU model: "NVIDIA H100 80GB HBM3" -> h100
        args.tag = gpu_tag()
    if note := tag_device_mismatch(args.tag, meta["device"]):
        log(f"WARNING: {note}: the report says so")
        meta["tag_note"] = note
    timer, rows, ok = Timer(), [], True
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for H in [int(h) for h in args.heads.split(",")]:
        for B, N in shapes:
            ok &= bench_shape(H, B, N, args.formats.split(","), fm_ext, timer, args.reps, rows, args.rounds,
                              args.ragged)  # fmt: skip
            write_outputs(args.out, args.tag, {**meta, "partial": True}, rows, plot=False)  # a killed run keeps these
    meta["seconds"] = round(time.time() - t0, 1)
    meta["all_checks_ok"] = ok
    write_outputs(args.out, args.tag, meta, rows)
    summary = {f"{r['impl']}_h{r['heads']}_b{r['batch']}_n{r['context']}": r.get("us") and round(r["us"], 1)
               for r in rows}  # fmt: skip
    print(json.dumps({"ok": ok, **summary}))


if __name__ == "__main__":
    main()
