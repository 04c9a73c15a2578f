"""Where a CUDA decode call's time goes on the GPU: the page kernel, the BF16 sink/local buffers, the split merge,
and the fixed cost of a CTA (prologue, partial writes, launch) apart from its cost per page.

``decode_attention(impl="cuda")`` is three launches (:func:`quantmla.kernels.cuda_decode.launch_decode`): the page
kernel, the Triton kernel of the BF16 sink/local buffers on a side stream beside it, and the split merge after
both. Fitted over the benchmark shapes of ``bench_decode.py``, C4R4's time is ~32-36 us plus ~2.7 us per page per
CTA (H200, 2026-12-01, ``decode_vs_flashmla_h200_s12.md``): the fixed part is most of B1 x 128K and B32 x 4K. This
script measures it instead of fitting it:

* **parts**: at each shape, the whole call, each launch alone and the page kernel + merge, each captured in a CUDA
  graph and timed like ``bench_decode.py`` (replay after an L2 flush, median of ``--reps``), beside an empty graph
  (a one-element add: the timer's floor);
* **per CTA**: at a fixed grid (``--splits`` splits of ``--sweep-batch`` sequences), contexts of ``k`` pages per
  CTA for each ``k`` in ``--pages``; least squares ``t = a + b k`` for the whole call and for the page kernel alone:
  ``a`` is what a CTA costs before and after its pages (plus the launches), ``b`` the cost of a page;
* **splits**: the whole call at other split counts than the heuristic's (``--split-sweep``).

Every configuration is checked first against the fp32 torch reference of the same bytes (relative L2 <= 5e-3,
LSE <= 2e-2). (Its first run, ``decode_breakdown_h200_s13.md``, also timed the buffer kernel launched first: never
faster, since removed.) Writes
``decode_breakdown_<tag>.{json,md}`` to ``--out``. GPU only::

    PYTHONPATH=src python benchmarks/decode_breakdown.py --out benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import DC, DR, LSE_TOL, REL_TOL, SCALE, Timer, build_cache, lse_err, q_as_kernel_rounds, rel_err  # noqa: E402, I001
from bench_prefill import commit_id  # noqa: E402 - the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
from results_io import parse_gpu_args, write_results  # noqa: E402
from quantmla.kernels.cuda_decode import launch_decode, plan_decode  # noqa: E402
from quantmla.kernels.reference import decode_attention_torch  # noqa: E402

PARTS = {"all": ("pages", "buffers", "combine"), "pages": ("pages",), "buffers": ("buffers",),
         "combine": ("combine",), "pages+combine": ("pages", "combine")}  # fmt: skip


def fit(ks: list[int], ts: list[float]) -> tuple[float, float]:
    """Least squares ``t = a + b k`` -> (a, b)."""
    n = len(ks)
    mk, mt = sum(ks) / n, sum(ts) / n
    sxx = sum((k - mk) ** 2 for k in ks)
    b = sum((k - mk) * (t - mt) for k, t in zip(ks, ts)) / sxx if sxx else 0.0
    return mt - b * mk, b


def timer_floor(timer: Timer, reps: int) -> float:
    """us of an empty graph (a one-element add): what the timer itself costs."""
    one = torch.zeros(1, device="cuda")
    return timer(lambda: one.add_(1), reps)


def time_parts(plan, timer: Timer, reps: int, names) -> dict[str, float]:
    """us of each named part set of :data:`PARTS` for ``plan``."""
    runs = {name: (lambda parts=PARTS[name]: launch_decode(plan, parts)) for name in names if name in PARTS}
    return {f"{name}_us": timer(fn, reps) for name, fn in runs.items()}


def setup(fmt: str, H: int, B: int, N: int, kernel: str, splits: int | None, seed: int):
    """(plan, check) for one configuration: a random cache of ``fmt``, q, the plan, and the check's numbers."""
    torch.manual_seed(seed)
    kv = torch.randn(B, N, DC + DR, device="cuda").bfloat16()
    kv[..., :DC] *= torch.linspace(0.2, 3.0, DC, device="cuda").bfloat16()
    q_lat = torch.randn(B, H, DC, device="cuda").bfloat16()
    q_pe = torch.randn(B, H, DR, device="cuda").bfloat16()
    cache = build_cache(fmt, kv, [N] * B, seed=seed)
    del kv
    plan = plan_decode(q_lat, q_pe, cache, SCALE, num_splits=splits, kernel=kernel)
    out, lse = launch_decode(plan)
    qr_lat, qr_pe = q_as_kernel_rounds(q_lat, "cuda"), q_as_kernel_rounds(q_pe, "cuda")
    ref, ref_lse = decode_attention_torch(qr_lat, qr_pe, cache, SCALE, return_lse=True)
    rel, le = rel_err(out, ref), lse_err(lse, ref_lse)
    return plan, {"rel": rel, "lse_err": le, "ok": rel <= REL_TOL and le <= LSE_TOL}


def add_call_args(ap, shapes: str, doc: str) -> None:
    """The arguments that say which decode calls to set up (``setup``): formats, heads, kernel, shapes."""
    ap.add_argument("--formats", default="c4r4,c8r8")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kernel", default="auto", help="mma, wgmma, ws or auto (default)")
    ap.add_argument("--shapes", default=shapes, help=doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(ap, "1x131072,32x4096,8x32768,32x32768", "BxN,... for the parts")
    ap.add_argument("--sweep-batch", type=int, default=32)
    ap.add_argument("--splits", type=int, default=8, help="splits per sequence in the per-CTA sweep")
    ap.add_argument("--pages", default="1,2,4,8,16,32", help="pages per CTA in the sweep")
    ap.add_argument("--split-sweep", default="32x4096:4,8,16;1x131072:128,256,512",
                    help="BxN:splits,...;... -- the whole call at each split count (the split heuristic's choice)")
    ap.add_argument("--reps", type=int, default=30)
    args, stem = parse_gpu_args(ap, "decode_breakdown", "decode_breakdown.py times CUDA kernels")
    timer = Timer()
    floor = timer_floor(timer, args.reps)
    print(f"empty graph (timer floor): {floor:.1f} us", flush=True)
    parts_rows, sweep_rows, split_rows, fits, ok_all = [], [], [], [], True
    H = args.heads
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            B, N = (int(v) for v in shape.split("x"))
            plan, chk = setup(fmt, H, B, N, args.kernel, None, seed=B + N)
            ok_all &= chk["ok"]
            row = {"format": fmt, "heads": H, "batch": B, "context": N, "kernel": plan.kernel, "splits": plan.ns,
                   "buffer_tiles": plan.ns_total - plan.ns, **chk}  # fmt: skip
            row.update(time_parts(plan, timer, args.reps, tuple(PARTS)))
            parts_rows.append(row)
            print(json.dumps(row), flush=True)
            plan = None
            torch.cuda.empty_cache()
        ks = [int(v) for v in args.pages.split(",")]
        full, pages = [], []
        for k in ks:
            B, N = args.sweep_batch, 64 * args.splits * k
            plan, chk = setup(fmt, H, B, N, args.kernel, args.splits, seed=k)
            ok_all &= chk["ok"]
            ts = time_parts(plan, timer, args.reps, ("all", "pages"))
            full.append(ts["all_us"])
            pages.append(ts["pages_us"])
            sweep_rows.append({"format": fmt, "heads": H, "batch": B, "context": N, "kernel": plan.kernel,
                               "splits": plan.ns, "pages_per_cta": k, **ts, **chk})  # fmt: skip
            print(json.dumps(sweep_rows[-1]), flush=True)
            plan = None
            torch.cuda.empty_cache()
        for item in filter(None, args.split_sweep.split(";")):
            shape, _, counts = item.partition(":")
            B, N = (int(v) for v in shape.split("x"))
            for ns in (int(v) for v in counts.split(",")):
                plan, chk = setup(fmt, H, B, N, args.kernel, ns, seed=B + N + ns)
                ok_all &= chk["ok"]
                split_rows.append({"format": fmt, "heads": H, "batch": B, "context": N, "kernel": plan.kernel,
                                   "splits": plan.ns, **time_parts(plan, timer, args.reps, ("all",)), **chk})
                print(json.dumps(split_rows[-1]), flush=True)
                plan = None
                torch.cuda.empty_cache()
        (a_all, b_all), (a_pg, b_pg) = fit(ks, full), fit(ks, pages)
        fits.append({"format": fmt, "batch": args.sweep_batch, "splits": args.splits, "all_fixed_us": a_all,
                     "all_per_page_us": b_all, "pages_fixed_us": a_pg, "pages_per_page_us": b_pg})  # fmt: skip
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    meta = {"device": torch.cuda.get_device_name(), "date": date, "commit": commit_id(), "command": " ".join(sys.argv),
            "timer_floor_us": floor, "ok": ok_all}  # fmt: skip
    write(stem, meta, parts_rows, sweep_rows, fits, split_rows)
    print(json.dumps({"ok": ok_all, "floor_us": round(floor, 1), "fits": fits}))
    return 0 if ok_all else 1


def write(stem: str, meta: dict, parts_rows: list, sweep_rows: list, fits: list, split_rows: list = ()) -> None:
    lines = [f"# Decode call breakdown, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`: each part captured in a CUDA graph and replayed after an L2 flush (median); "
             f"an empty graph times {meta['timer_floor_us']:.1f} us. Every configuration checked first "
             f"({'all passed' if meta['ok'] else 'SOME FAILED'}).", "",
             "| format | B x context | kernel | splits | all | pages | buffers | combine | pages + combine |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in parts_rows:
        lines.append(f"| {r['format']} | {r['batch']} x {r['context']} | {r['kernel']} | {r['splits']} "
                     f"| {r['all_us']:.1f} | {r['pages_us']:.1f} | {r['buffers_us']:.1f} | {r['combine_us']:.1f} "
                     f"| {r['pages+combine_us']:.1f} |")  # fmt: skip
    lines += ["", "Per CTA: a fixed grid, contexts of k pages per CTA (us):", "",
              "| format | B | splits | pages per CTA | all | pages |", "|---|---|---|---|---|---|"]
    for r in sweep_rows:
        lines.append(f"| {r['format']} | {r['batch']} | {r['splits']} | {r['pages_per_cta']} | {r['all_us']:.1f} "
                     f"| {r['pages_us']:.1f} |")  # fmt: skip
    lines += ["", "Fit t = a + b k (us):", "", "| format | all: a | all: b | pages: a | pages: b |",
              "|---|---|---|---|---|"]
    for f in fits:
        lines.append(f"| {f['format']} | {f['all_fixed_us']:.1f} | {f['all_per_page_us']:.2f} "
                     f"| {f['pages_fixed_us']:.1f} | {f['pages_per_page_us']:.2f} |")  # fmt: skip
    if split_rows:
        lines += ["", "Split counts (the whole call, us):", "", "| format | B x context | kernel | splits | all |",
                  "|---|---|---|---|---|"]
        for r in split_rows:
            lines.append(f"| {r['format']} | {r['batch']} x {r['context']} | {r['kernel']} | {r['splits']} "
                         f"| {r['all_us']:.1f} |")  # fmt: skip
    doc = {"meta": meta, "parts": parts_rows, "sweep": sweep_rows, "fits": fits, "splits": list(split_rows)}
    write_results(stem, {".json": json.dumps(doc, indent=1), ".md": "\n".join(lines) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
