"""Split-K planning of the CUDA decode kernels (``quantmla.kernels.split_plan``): which splits have pages, the plan
for ragged lengths, and the C++ mirror the page kernels and the merge use (``csrc/mla_page.cuh``)."""

from __future__ import annotations

import heapq
import itertools
import random
import subprocess

import pytest

from quantmla.kernels.paged import PagedMLACache
from quantmla.kernels.split_plan import (
    PAGE,
    _cost,
    cuda_num_splits,
    packed_page_counts,
    packed_pages,
    split_plan,
    used_splits,
)
from quantmla.quant.formats import CachePolicy

H200_SLOTS = 132 * 2  # SMs x CTAs of the wgmma kernel per SM


def kernel_splits(n: int, sink: int, local: int, pps: int, ns: int) -> list[range]:
    """The page range of each split as the page kernels compute it (pg0, pg1 in csrc/decode_mla_sm90.cu)."""
    lo, hi = sink, max(n - local, sink)
    out = []
    for sp in range(ns):
        pg0 = lo // PAGE + sp * pps
        out.append(range(pg0, min(pg0 + pps, -(-hi // PAGE))))
    return out


@pytest.mark.parametrize("sink,local", [(0, 0), (4, 128), (64, 64), (3, 1), (60, 0)])
def test_the_splits_with_pages_are_a_prefix_that_covers_every_packed_token(sink, local):
    """Against the cache's own definition of the tokens read from pages (PagedMLACache.packed_range): every one lies
    on a page some split walks, each page is walked once, and a walked page holds a packed token or is the first."""
    cache = PagedMLACache("c4r4", 1, 800, policy=CachePolicy(sink=sink, local=local, page_size=PAGE), num_pages=16)
    for n, pps in itertools.product(range(0, 700, 7), (1, 2, 3, 7, 64)):
        ns = max(1, -(-packed_pages(n, cache.n_sink, cache.n_local) // pps)) + 2  # two splits too many
        splits = kernel_splits(n, cache.n_sink, cache.n_local, pps, ns)
        used = used_splits(n, cache.n_sink, cache.n_local, pps, ns)
        assert [len(r) > 0 for r in splits] == [True] * used + [False] * (ns - used)
        walked = [p for r in splits for p in r]
        assert len(walked) == len(set(walked)) == packed_pages(n, cache.n_sink, cache.n_local)
        packed = set(cache.packed_range(n))
        assert packed <= {t for p in walked for t in range(PAGE * p, PAGE * p + PAGE)}
        assert all(p == walked[0] or packed & set(range(PAGE * p, PAGE * p + PAGE)) for p in walked)


def test_page_counts_are_the_sorted_packed_pages():
    lens = (5000, 0, 131, 132, 133, 64 * 9 + 128)
    assert packed_page_counts(lens, 4, 128) == tuple(sorted(packed_pages(n, 4, 128) for n in lens))
    assert packed_page_counts(lens, 4, 128) == (1, 1, 1, 1, 9, 77)  # 133 - 128 = 5 > 4: still page 0 alone


def test_used_splits_is_capped_by_the_split_count():
    assert used_splits(64 * 100, 0, 0, pps=10, ns=4) == 4
    assert used_splits(0, 0, 128, pps=10, ns=4) == 0
    assert used_splits(0, 4, 128, pps=10, ns=4) == 1  # page 0 holds the sink tokens: walked, every token masked


def makespan(pages: list[int], head_groups: int, slots: int, ns: int) -> int:
    """Greedy list scheduling of the grid (x fastest, then splits, then sequences) on ``slots`` CTA slots; a CTA with
    k pages takes k + 1, one without pages 0 (it exits at once)."""
    longest = max(pages)
    pps = -(-longest // ns)
    free = [0] * slots
    for p in pages:
        for sp in range(ns):
            k = max(0, min(pps, p - sp * pps))
            for _ in range(head_groups):
                if k:
                    t = heapq.heappop(free)
                    heapq.heappush(free, t + k + 1)
    return max(free)


def test_equal_lengths_plan_is_never_worse_than_the_equal_lengths_rule():
    rng = random.Random(0)
    for _ in range(300):
        b, hg, longest, slots = rng.randint(1, 64), rng.randint(1, 8), rng.randint(1, 2100), rng.choice([132, 264, 396])
        ns = split_plan((longest,) * b, hg, slots)
        old = cuda_num_splits(b, hg, longest, slots)
        assert -(-longest // ns) * ns >= longest  # the grid covers the longest sequence
        equal = (longest,) * b
        assert _cost(equal, hg, slots, -(-longest // ns)) <= _cost(equal, hg, slots, -(-longest // old))


def test_plan_is_the_cheapest_split_count_below_its_cap_and_the_fewest_among_ties():
    rng = random.Random(1)
    for _ in range(200):
        pages = tuple(sorted(rng.randint(0, 600) for _ in range(rng.randint(1, 40))))
        hg, slots = rng.randint(1, 4), rng.choice([16, 132, 264])
        longest = max(pages)
        ns = split_plan(pages, hg, slots)
        if longest <= 1:
            assert ns == 1
            continue
        cap = max(cuda_num_splits(len(pages), hg, longest, slots), -(-2 * slots // (len(pages) * hg)))
        options = {}  # split count -> its cost, by brute force over every split count up to the cap
        for k in range(1, min(cap, longest) + 1):
            pps = -(-longest // k)
            options.setdefault(-(-longest // pps), _cost(pages, hg, slots, pps))
        best = min(options.values())
        assert options[ns] == best and ns == min(k for k, c in options.items() if c == best)


def test_ragged_batch_gets_its_own_plan_and_finishes_far_sooner():
    """32 sequences from 4K to 32K tokens (a serving batch): the equal-lengths rule plans for 32 x 32K and the short
    sequences' CTAs leave SMs idle while the longest ones run; the lengths' own plan splits the long ones further."""
    lens = [int(32768 * (1 / 8 + 7 / 8 * b / 31)) for b in range(32)]
    pages = [packed_pages(n, 4, 128) for n in lens]
    ns = split_plan(tuple(sorted(pages)), 1, H200_SLOTS)
    old = cuda_num_splits(32, 1, max(pages), H200_SLOTS)
    assert ns > old
    assert makespan(pages, 1, H200_SLOTS, ns) < 0.7 * makespan(pages, 1, H200_SLOTS, old)
    # equal lengths: the same split count as the equal-lengths rule at the benchmark's shapes
    for b, n in ((32, 32768), (8, 131072), (1, 131072), (32, 4096)):
        p = packed_pages(n, 4, 128)
        assert split_plan((p,) * b, 1, H200_SLOTS) == -(-p // -(-p // cuda_num_splits(b, 1, p, H200_SLOTS)))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="head_groups"):
        split_plan((10, 20), 0, 264)
    with pytest.raises(ValueError, match="page counts"):
        split_plan((10, -1), 1, 264)


def test_the_cuda_mirror_agrees(tmp_path):
    """csrc/mla_page.cuh's packed_pages / used_splits (what the page kernels and the merge compute) against these."""
    from quantmla.kernels.cuda_build import CSRC, find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    src = tmp_path / "mirror.cu"
    src.write_text(
        '#include <stdio.h>\n#include "mla_page.cuh"\nint main() {\n'
        "  const int sl[4][2] = {{0, 0}, {4, 128}, {64, 64}, {3, 1}};\n"
        "  for (int c = 0; c < 4; ++c) for (int n = 0; n < 1000; n += 13) for (int pps = 1; pps < 40; pps += 9)\n"
        '    printf("%d %d %d %d\\n", qmla::packed_pages(n, sl[c][0], sl[c][1]),\n'
        "           qmla::used_splits(n, sl[c][0], sl[c][1], pps, 5), n, pps);\n  return 0;\n}\n"
    )
    exe = tmp_path / "mirror"
    r = subprocess.run([nvcc, "-std=c++17", "-I", str(CSRC), "-o", str(exe), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [tuple(map(int, ln.split())) for ln in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                 check=True).stdout.splitlines()]  # fmt: skip
    want = [(packed_pages(n, s, lo), used_splits(n, s, lo, pps, 5), n, pps)
            for s, lo in ((0, 0), (4, 128), (64, 64), (3, 1)) for n in range(0, 1000, 13) for pps in range(1, 40, 9)]
    assert got == want


def test_merging_the_splits_with_pages_and_the_buffers_is_the_whole_attention():
    """The contract end to end in fp64 on a real cache (CPU): each split with pages attends over the packed tokens of
    its pages (the kernels' token mask), the BF16 buffers over the sink and local tokens, and the log-sum-exp merge of
    those slots alone -- the empty splits never read -- equals attention over every token (the torch reference)."""
    import torch

    from quantmla.kernels.reference import decode_attention_torch

    page, lens, H = 16, [0, 3, 20, 21, 37, 90, 200], 3
    cache = PagedMLACache("c4r4", len(lens), 256, kv_lora_rank=128, rope_dim=32, num_pages=64,
                          policy=CachePolicy(sink=4, local=16, page_size=page))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    cache.write(torch.randn(len(lens), 200, 128, generator=g), torch.randn(len(lens), 200, 32, generator=g), lens,
                impl="torch")  # fmt: skip
    q_lat, q_pe = torch.randn(len(lens), H, 128, generator=g), torch.randn(len(lens), H, 32, generator=g)
    scale = 0.1
    ref, ref_lse = decode_attention_torch(q_lat, q_pe, cache, scale, return_lse=True)
    pages = packed_page_counts(tuple(lens), cache.n_sink, cache.n_local, page)
    ns = split_plan(pages, 1, 4)
    pps = -(-max(pages) // ns)
    for b, n in enumerate(lens):
        q = torch.cat([q_lat[b], q_pe[b]], -1).double()  # [H, 160]
        keys = cache.read_tokens(b, n).double() if n else torch.zeros(0, 160, dtype=torch.float64)
        hi = max(n - cache.n_local, cache.n_sink)
        used = used_splits(n, cache.n_sink, cache.n_local, pps, ns, page)
        slots = []  # (tokens of each slot the merge reads): the splits with pages, then the buffers
        for sp in range(used):
            pg0 = cache.n_sink // page + sp * pps
            pg1 = min(pg0 + pps, -(-hi // page))
            slots.append([t for t in range(page * pg0, page * pg1) if cache.n_sink <= t < hi])  # the kernels' mask
        sink, local = cache.bf16_positions(n)
        slots += [list(sink), list(local)]
        o, lse = torch.zeros(H, 128, dtype=torch.float64), torch.full((H,), float("-inf"), dtype=torch.float64)
        for toks in slots:  # merge one slot at a time (log-sum-exp)
            if not toks:
                continue
            s = (q @ keys[toks].T) * scale
            s_lse = torch.logsumexp(s, -1)
            new = torch.logaddexp(lse, s_lse)
            part = torch.softmax(s, -1) @ keys[toks, :128]
            o = o * torch.exp(lse - new)[:, None] + part * torch.exp(s_lse - new)[:, None]
            lse = new
        covered = sorted(t for toks in slots for t in toks)
        assert covered == list(range(n))  # every token once, from the splits with pages and the buffers
        assert torch.allclose(o.float(), ref[b], atol=1e-5) and torch.allclose(lse.float(), ref_lse[b], atol=1e-5)
