"""The device timeline of one CUDA decode call: how long each of its kernels runs on the GPU, the gaps between them,
and the span from the first kernel's start to the last one's end.

``decode_breakdown.py`` times each launch of a call apart, each from the host (a CUDA graph replayed between
events), so its numbers include launch latency and it cannot say whether the ~17 us fixed part of the page kernel is
launch, prologue or epilogue. This script captures the whole call (page kernel, BF16 sink/local buffers, split merge)
in a CUDA graph, replays it after an L2 flush under ``torch.profiler`` (CUPTI kernel records) and reads the kernels'
own start and end times. Every configuration is checked first against the fp32 torch reference of the same bytes.
Writes ``decode_trace_<tag>.{json,md}`` to ``--out``. GPU only::

    PYTHONPATH=src python benchmarks/decode_trace.py --out benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import parse_gpu_args, write_results  # noqa: E402

ROLES = (("pages", ("decode_kernel",)), ("buffers", ("_buffers_kernel",)), ("combine", ("combine",)))


def role(name: str) -> str | None:
    """Which part of a decode call a kernel name is (None: not ours, e.g. the L2 flush)."""
    for r, keys in ROLES:
        if any(k in name for k in keys):
            return r
    return None


def summarize(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """``events``: (kernel name, start us, end us) of several replays of one call, in any order; a replay is the
    run of our kernels between two foreign kernels (the L2 flush before each). Returns medians over the replays:
    each part's device time, the span (first start to last end), the gap from the page kernel's end to the merge's
    start, the tail from the page kernel's end to the merge's end (what the merge adds to the call: with
    programmatic launches it starts early and waits, so its own time includes the wait), and the number of
    replays."""
    ev = sorted(events, key=lambda e: e[1])
    replays, cur = [], {}
    for name, t0, t1 in ev:
        r = role(name)
        if r is None:
            if cur:
                replays.append(cur)
            cur = {}
            continue
        if r in cur:
            raise ValueError(f"two {r} kernels in one replay at {t0:.1f} us: interleave a foreign kernel (L2 flush)")
        cur[r] = (t0, t1)
    if cur:
        replays.append(cur)
    replays = [r for r in replays if "pages" in r and "combine" in r]
    if not replays:
        raise ValueError("no replay with both the page kernel and the merge in the trace")
    out = {"replays": len(replays)}
    for part, _ in ROLES:
        vals = [r[part][1] - r[part][0] for r in replays if part in r]
        if vals:
            out[f"{part}_us"] = statistics.median(vals)
    out["span_us"] = statistics.median(max(e for _, e in r.values()) - min(s for s, _ in r.values()) for r in replays)
    out["gap_us"] = statistics.median(r["combine"][0] - r["pages"][1] for r in replays)
    out["tail_us"] = statistics.median(r["combine"][1] - r["pages"][1] for r in replays)
    return out


def trace_call(plan, reps: int) -> list[tuple[str, float, float]]:
    """(name, start, end) of every kernel of ``reps`` graph replays of ``plan``'s call, each after an L2 flush."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from quantmla.kernels.cuda_decode import launch_decode

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    launch_decode(plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_decode(plan)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]  # fmt: skip


def main() -> int:
    import torch

    from decode_breakdown import add_call_args, setup  # the breakdown's arguments, cache, plan and check

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(ap, "1x131072,32x4096,8x32768,32x32768,32x512", "BxN,...")
    ap.add_argument("--reps", type=int, default=30)
    args, stem = parse_gpu_args(ap, "decode_trace", "decode_trace.py profiles CUDA kernels")
    from bench_prefill import commit_id

    rows, ok_all = [], True
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            B, N = (int(v) for v in shape.split("x"))
            plan, chk = setup(fmt, args.heads, B, N, args.kernel, None, seed=B + N)
            ok_all &= chk["ok"]
            row = {"format": fmt, "heads": args.heads, "batch": B, "context": N, "kernel": plan.kernel,
                   "splits": plan.ns, **chk, **summarize(trace_call(plan, args.reps))}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            plan = None
            torch.cuda.empty_cache()
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    meta = {"device": torch.cuda.get_device_name(), "date": date, "commit": commit_id(), "command": " ".join(sys.argv),
            "ok": ok_all}  # fmt: skip
    write(stem, meta, rows)
    return 0 if ok_all else 1


def write(stem: str, meta: dict, rows: list) -> None:
    lines = [f"# Decode call timeline, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`: the whole call captured in a CUDA graph, replayed after an L2 flush under "
             "torch.profiler; each kernel's own device time (median over replays), the span from the first "
             "kernel's start to the last one's end, and the gap from the page kernel's end to the merge's start (with "
             "programmatic launches, the default since 2026-12-01, the merge starts early and waits: its time then "
             "includes the wait and the gap is negative). "
             f"Every configuration checked first ({'all passed' if meta['ok'] else 'SOME FAILED'}).", "",
             "| format | B x context | kernel | splits | pages | buffers | combine | gap pages -> combine "
             "| tail after pages | span |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    nan = float("nan")
    for r in rows:
        lines.append(f"| {r['format']} | {r['batch']} x {r['context']} | {r['kernel']} | {r['splits']} "
                     f"| {r.get('pages_us', nan):.1f} | {r.get('buffers_us', nan):.1f} "
                     f"| {r.get('combine_us', nan):.1f} | {r['gap_us']:.1f} | {r.get('tail_us', nan):.1f} "
                     f"| {r['span_us']:.1f} |")  # fmt: skip
    write_results(stem, {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
