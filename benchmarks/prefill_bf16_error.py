"""Where the GPU prefill path's error comes from, on the CPU: the SDPA path (BF16 workspace + torch's fused
attention) against the fp32 reference, the error split by source, and the BF16 error check of
tests/kernels/test_prefill.py on clean output and on outputs that read one token from the wrong copy.

The case is the GPU test's (DeepSeek widths, lengths 1000/300/0 + 16/9/16 new tokens, 16 heads, unit queries).
Sources: ``q`` = the reference recomputed from BF16-rounded queries; ``q+ws`` = fp32 attention on BF16-rounded
queries and workspace (no kernel rounding); ``path`` = the BF16 path itself. ``off`` = elements outside the old
elementwise bound 3e-2 + 3e-2 |ref|; ``ratio`` = the largest row error / its predicted BF16 std (the test's
limit: ``RATIO``). Mutations: ``recent-row`` (the BF16 copy of the token before the chunk replaced by its packed
copy), ``sink-1``/``local-1`` (the path's mask reads the last sink token / the oldest window token packed),
``sink+1``/``local+1`` (one more token read from BF16).

    PYTHONPATH=src python benchmarks/prefill_bf16_error.py [--formats c2r4,c8r8] [--page 16]

CPU only, about 30 s per format on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

import test_prefill as T  # noqa: E402

import quantmla.kernels.prefill as sdpa_module  # noqa: E402
from quantmla.kernels import prefill_attention  # noqa: E402
from quantmla.kernels.prefill import prefill_attention_sdpa  # noqa: E402
from quantmla.quant.formats import CachePolicy  # noqa: E402


class _RoundedWorkspace:
    """The cache with its dequantized copies rounded to BF16 (what the path's workspace holds)."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def read_packed(self, b, pos):
        return self._cache.read_packed(b, pos).bfloat16().float()


def _row_ratio(out, ref, sigma) -> float:
    err = (out.double() - ref.double()).norm(dim=-1)
    m = sigma > 0
    return (err[m] / sigma[m]).max().item()


def _shifted(ds: int, dl: int):
    real = dataclasses.replace

    def replace(policy, **kw):
        p = real(policy, **kw)
        return real(p, sink=p.sink + ds, local=p.local + dl)

    return replace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="c2r4,c8r8,c4r4,bf16")
    ap.add_argument("--page", type=int, default=64, help="page size (the GPU test uses 64; session 8 ran 16)")
    args = ap.parse_args()
    policy = CachePolicy(sink=4, local=16, page_size=args.page)
    lens, n_new = [1000, 300, 0], [16, 9, 16]
    for name in args.formats.split(","):
        cache, raw, recent = T._appended(name, lens, n_new, T=16, dc=512, dr=64, policy=policy)
        q_lat, q_pe = T._q(3, 16, 16, 512, 64)
        run = dict(recent=recent, impl="sdpa")
        ref = prefill_attention(q_lat, q_pe, cache, T.SCALE, n_new, recent=recent, impl="torch").double()
        ql, qp = q_lat.bfloat16().float(), q_pe.bfloat16().float()
        outs = {
            "q": prefill_attention(ql, qp, cache, T.SCALE, n_new, recent=recent, impl="torch"),
            "q+ws": prefill_attention_sdpa(
                ql, qp, _RoundedWorkspace(cache), T.SCALE, n_new, recent=recent, dtype=torch.float32
            ),
            "path": prefill_attention(q_lat, q_pe, cache, T.SCALE, n_new, **run),
        }
        sigma = T._sigma(cache, raw, q_lat, q_pe, n_new, 512)
        for label, o in outs.items():
            o = o.double()
            off = int(((o - ref).abs() > 3e-2 + 3e-2 * ref.abs()).sum())
            rel = ((o - ref).norm() / ref.norm()).item()
            print(f"{name:5s} {label:10s} rel-L2 {rel:.2e}  max |err| {(o - ref).abs().max():.3f}  off {off:3d}  "
                  f"ratio {_row_ratio(o, ref, sigma):6.2f}", flush=True)  # fmt: skip
        if not cache.fmt.is_quantized:
            continue
        pos, n, W = lens[0] - 1, cache.lengths()[0], recent.shape[1]
        wrong = recent.clone()
        wrong[0, pos - (n - W)] = cache.read_packed(0, torch.tensor([pos]))[0].bfloat16()
        o = prefill_attention(q_lat, q_pe, cache, T.SCALE, n_new, recent=wrong, impl="sdpa")
        print(f"{name:5s} {'recent-row':10s} ratio {_row_ratio(o, ref, sigma):6.2f}", flush=True)
        for label, ds, dl in (("sink-1", -1, 0), ("sink+1", 1, 0), ("local-1", 0, -1), ("local+1", 0, 1)):
            real = sdpa_module.replace
            sdpa_module.replace = _shifted(ds, dl)
            try:
                o = prefill_attention(q_lat, q_pe, cache, T.SCALE, n_new, **run)
            finally:
                sdpa_module.replace = real
            print(f"{name:5s} {label:10s} ratio {_row_ratio(o, ref, sigma):6.2f}", flush=True)


if __name__ == "__main__":
    main()
