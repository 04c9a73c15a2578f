"""Does the decode kernels' time depend on how much GPU memory is allocated around them? (issue 9)

``bench_decode.py --rounds 3`` (2026-12-03) saw our kernels 5-12% slower at B32 x 128K in rounds 2-3, with every
implementation's cache kept alive, while FlashMLA did not move. A serving engine's cache fills the GPU, so this
matters. Here one shape (default B32 x 128K, 16 heads), FlashMLA BF16 (``--flashmla-prebuilt``) and our formats on
their caches (each checked first against the fp32 reference of the same bytes), timed in phases, round-robin, with
"ballast" tensors (filled, so their pages are really mapped) of growing size allocated between the phases, then
freed. Same timer as ``bench_decode.py`` (CUDA-graph replay after an L2 flush, median of ``--reps``).

Writes ``decode_footprint_<tag>.{json,md}`` to ``--out``. On the GPU machine::

    PYTHONPATH=src python benchmarks/decode_footprint.py --flashmla-prebuilt .fmbuild/flashmla_dense_bench.so \\
        --out $OUT/b --tag h200_s24
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402 - the same shapes, caches, checks and timer
from results_io import gpu_tag, write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashmla-prebuilt", default=None, help="FlashMLA's extension (flashmla_dense_bench.so)")
    ap.add_argument("--shape", default="32x131072", help="BxN (default %(default)s)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--formats", default="c4r4,c8r8")
    ap.add_argument("--ballast-gb", default="0,20,60,100,0", help="GB allocated around the kernels, phase by phase")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds per phase")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="default: the GPU model that runs (h100, h200)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_footprint.py needs a CUDA GPU")
    B, N = (int(v) for v in args.shape.split("x"))
    H = args.heads
    torch.manual_seed(0)
    kv = torch.randn(B, N, bd.DC + bd.DR, device="cuda").bfloat16()
    kv[..., : bd.DC] *= torch.linspace(0.2, 3.0, bd.DC, device="cuda").bfloat16()
    q_lat = torch.randn(B, H, bd.DC, device="cuda").bfloat16()
    q_pe = torch.randn(B, H, bd.DR, device="cuda").bfloat16()
    lens = [N] * B
    impls = {}
    if args.flashmla_prebuilt:
        from flashmla_ext import FlashMLADecode, load_prebuilt

        kcache, bt = bd.flashmla_inputs(kv, seed=N)
        q = torch.cat([q_lat, q_pe], -1).unsqueeze(1).contiguous()
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        impls["flashmla-bf16"] = FlashMLADecode(load_prebuilt(args.flashmla_prebuilt), q, kcache, lens_t, bt, bd.SCALE)
    checks = {}
    for fmt in args.formats.split(","):
        c = bd.build_cache(fmt, kv, lens, seed=B + N)

        def run(c=c, **kw):
            return bd.decode_attention(q_lat, q_pe, c, bd.SCALE, **kw)

        out, lse = run(return_lse=True)
        qr_lat, qr_pe = bd.q_as_kernel_rounds(q_lat, "cuda"), bd.q_as_kernel_rounds(q_pe, "cuda")
        ref, ref_lse = bd.decode_attention_torch(qr_lat, qr_pe, c, bd.SCALE, return_lse=True)
        checks[fmt] = {"rel": bd.rel_err(out, ref), "lse_err": bd.lse_err(lse, ref_lse)}
        if checks[fmt]["rel"] > bd.REL_TOL or checks[fmt]["lse_err"] > bd.LSE_TOL:
            raise SystemExit(f"{fmt}: wrong result ({checks[fmt]}); not timed")
        impls[fmt] = run
        del out, lse, ref, ref_lse
    torch.cuda.empty_cache()
    timer, phases, ballast = bd.Timer(), [], []
    for gb in (float(g) for g in args.ballast_gb.split(",")):
        ballast.clear()
        torch.cuda.empty_cache()
        left = int(gb * 1e9)
        while left > 0:  # 4 GB pieces, written so every page is mapped
            n = min(left, 4 << 30)
            ballast.append(torch.ones(n, dtype=torch.uint8, device="cuda"))
            left -= n
        times = {k: [] for k in impls}
        for _ in range(args.rounds):  # round-robin
            for k, fn in impls.items():
                times[k].append(timer(fn, args.reps))
        phase = {"ballast_gb": gb, "allocated_gb": torch.cuda.memory_allocated() / 1e9, "us": times}
        phases.append(phase)
        bd.log(f"ballast {gb:5.0f} GB (allocated {phase['allocated_gb']:.1f} GB): "
               + "  ".join(f"{k} " + "/".join(f"{u:.1f}" for u in v) for k, v in times.items()))  # fmt: skip
    ballast.clear()
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    meta = {"device": torch.cuda.get_device_name(), "date": now,
            "commit": os.environ.get("QUANTMLA_COMMIT", "unknown"), "command": " ".join(sys.argv), "batch": B,
            "context": N, "heads": H, "reps": args.reps, "rounds": args.rounds, "checks": checks}  # fmt: skip
    names = list(impls)
    lines = [f"# Decode time vs GPU memory allocated around it, {meta['device']}, {now}, commit {meta['commit']}",
             "", f"`{meta['command']}`; B{B} x {N}, {H} heads; per phase {args.rounds} round-robin rounds of the "
             f"median of {args.reps} CUDA-graph replays after an L2 flush (us, rounds separated by /).", "",
             "| ballast GB | allocated GB | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for p in phases:
        cells = ["/".join(f"{u:.1f}" for u in p["us"][k]) for k in names]
        lines.append(f"| {p['ballast_gb']:.0f} | {p['allocated_gb']:.1f} | " + " | ".join(cells) + " |")
    stem = os.path.join(args.out, f"decode_footprint_{args.tag or gpu_tag()}")
    os.makedirs(args.out, exist_ok=True)
    write_results(stem, {".json": json.dumps({"meta": meta, "phases": phases}, indent=1),
                         ".md": "\n".join(lines) + "\n"})  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
