"""benchmarks/decode_trace.py: the timeline summary splits a profiler trace into replays at the foreign kernels
(the L2 flush), takes each part's median device time, the span and the page-kernel-to-merge gap; a trace it cannot
split is a clear error, and without a GPU the script stops with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import decode_trace as dtr  # noqa: E402

PAGES = "void qmla::sm90::decode_kernel_sm90<4, 4, false, false, 16>(qmla::Params)"
COMBINE = "void qmla::combine_kernel<1, 512, 128>(float const*, float const*, float*, float*, int, int)"


def _replay(t, pages, buffers, gap, combine):
    """One replay at time t: a flush, the page kernel and the buffer kernel from t + 10, the merge after a gap."""
    return [("at::native::FillFunctor flush", t, t + 5), (PAGES, t + 10, t + 10 + pages),
            ("_buffers_kernel", t + 10.5, t + 10.5 + buffers),
            (COMBINE, t + 10 + pages + gap, t + 10 + pages + gap + combine)]  # fmt: skip


def test_summary_recovers_the_parts_of_each_replay():
    g = torch.Generator().manual_seed(1)
    events, truth = [], []
    for i in range(7):
        p, b, gap, c = (float(v) for v in torch.rand(4, generator=g, dtype=torch.float64) * torch.tensor(
            [40.0, 8.0, 3.0, 6.0], dtype=torch.float64) + 1)  # fmt: skip
        events += _replay(1000.0 * i, p, b, gap, c)
        truth.append((p, b, gap, c, max(p + gap + c, 0.5 + b), gap + c))
    events.reverse()  # any order
    s = dtr.summarize(events)
    med = [sorted(x)[3] for x in zip(*truth)]  # float64 medians of the 7 replays, computed apart
    assert s["replays"] == 7
    for key, want in zip(("pages_us", "buffers_us", "gap_us", "combine_us", "span_us", "tail_us"), med):
        assert s[key] == pytest.approx(want, abs=1e-9)


def test_a_trace_without_flushes_or_merge_is_refused():
    two = _replay(0.0, 10, 2, 1, 3)[1:] + _replay(100.0, 10, 2, 1, 3)[1:]  # no flush between the replays
    with pytest.raises(ValueError, match="two pages kernels in one replay"):
        dtr.summarize(two)
    with pytest.raises(ValueError, match="no replay with both"):
        dtr.summarize([(PAGES, 0.0, 5.0)])
    assert dtr.role("void at::native::vectorized_elementwise_kernel") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_trace.py"), "--out",
                          str(tmp_path)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH":
                          os.path.join(ROOT, "src")})  # fmt: skip
    assert res.returncode != 0 and "needs a CUDA GPU" in res.stderr
    assert not list(tmp_path.iterdir())
