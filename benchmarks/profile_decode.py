"""Run one decode shape a few times, for a profiler such as ncu: ``profile_decode.py c4r4 32 32768``.

Builds the cache like ``bench_decode.py`` (shuffled pages, fused writer) and calls ``decode_attention(impl=auto)``
``--reps`` times after one warm-up; nothing is checked or timed here (``bench_decode.py`` does that)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import DC, DR, SCALE, build_cache  # noqa: E402
from quantmla.kernels.dispatch import decode_attention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("fmt")
ap.add_argument("batch", type=int)
ap.add_argument("context", type=int)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--splits", type=int, default=None)
ap.add_argument("--table", action="store_true", help="print per-kernel CUDA times (torch.profiler)")
a = ap.parse_args()
kv = torch.randn(a.batch, a.context, DC + DR, device="cuda").bfloat16()
c = build_cache(a.fmt, kv, [a.context] * a.batch, seed=0)
q_lat = torch.randn(a.batch, a.heads, DC, device="cuda").bfloat16()
q_pe = torch.randn(a.batch, a.heads, DR, device="cuda").bfloat16()
decode_attention(q_lat, q_pe, c, SCALE, num_splits=a.splits)
torch.cuda.synchronize()
if a.table:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.reps):
            decode_attention(q_lat, q_pe, c, SCALE, num_splits=a.splits)
        torch.cuda.synchronize()
    print(f"{a.fmt} B={a.batch} N={a.context} H={a.heads}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))
else:
    for _ in range(a.reps):
        decode_attention(q_lat, q_pe, c, SCALE, num_splits=a.splits)
    torch.cuda.synchronize()
print("done")
