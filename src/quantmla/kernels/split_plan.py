"""Split-K planning of the CUDA decode kernels: how many CTAs share one sequence's packed pages.

The grid is ``(head CTAs, ns, B)``; split ``sp`` of a sequence covers ``pps`` of its packed pages from the first (the
sink and local tokens live in BF16 buffers, not in pages), and a split without pages exits at once without writing
anything: the merge reads of each sequence only the splits that had pages. So ``ns`` must cover the longest sequence,
and the shorter ones of a ragged batch cost their own pages only. The plan picks ``pps`` for the lengths themselves:
today's kernels are timed by their busiest SM, so it minimizes ``waves x (pps + 1)`` over the CTAs that have pages
(the 1: the prologue and the partial's write): the longest sequence gets as many splits as it needs to finish with
the others, and the short ones of a ragged batch no longer wait for it. The Triton BF16 kernel plans ragged batches
the same way (``triton_decode.plan_num_splits``: one program per split and sequence, all heads).

``packed_pages`` / ``used_splits`` are the host mirror of ``csrc/mla_page.cuh``'s functions of the same names (the
page kernels' early exit and the merge's choice of slots); the three must agree.
"""

from __future__ import annotations

import functools
import math

PAGE = 64  # tokens per page of the CUDA kernels (csrc/mla_page.cuh kPage)


def packed_pages(n: int, sink: int, local: int, page: int = PAGE) -> int:
    """Pages the page kernel walks for a sequence of ``n`` tokens: ``[sink // page, ceil(hi / page))`` with
    ``hi = max(n - local, sink)`` (a page holding only BF16-buffer tokens is walked and masked)."""
    hi = max(n - local, sink)
    return -(-hi // page) - sink // page


def used_splits(n: int, sink: int, local: int, pps: int, ns: int, page: int = PAGE) -> int:
    """Splits of a sequence of ``n`` tokens that have pages (the others exit at once; the merge skips them)."""
    return min(ns, -(-packed_pages(n, sink, local, page) // pps))


@functools.lru_cache(maxsize=256)
def packed_page_counts(lens: tuple[int, ...], sink: int, local: int, page: int = PAGE) -> tuple[int, ...]:
    """The sorted :func:`packed_pages` of sequences of these lengths: what :func:`split_plan` takes (cached, since
    every layer of a decode step asks for the same lengths: ~50 us for 256 sequences uncached)."""
    return tuple(sorted(packed_pages(n, sink, local, page) for n in lens))


def _cost(pages: tuple[int, ...], head_groups: int, slots: int, pps: int) -> int:
    ctas = head_groups * sum(-(-p // pps) for p in pages)
    return math.ceil(ctas / slots) * (pps + 1)


@functools.lru_cache(maxsize=4096)
def cuda_num_splits(batch: int, head_groups: int, max_pages: int, slots: int) -> int:
    """Split-K factor for ``batch`` sequences of ``max_pages`` pages each and ``slots`` resident CTAs (SMs x CTAs per
    SM) that fills whole waves: minimizes waves x (pages per CTA + 1) (the 1: prologue and partial writes), preferring
    fewer splits on ties. (Every sequence as long as the longest: the plan before ragged lengths were planned for.)"""
    slots = max(1, slots)
    best, best_cost = 1, float("inf")
    for ns in range(1, max_pages + 1):
        ctas = batch * head_groups * ns
        waves = math.ceil(ctas / slots)
        cost = waves * (math.ceil(max_pages / ns) + 1)
        if cost < best_cost - 1e-9:
            best, best_cost = ns, cost
    return best


@functools.lru_cache(maxsize=1024)
def split_plan(pages: tuple[int, ...], head_groups: int, slots: int) -> int:
    """Split count (the grid's y) for sequences of ``pages[b]`` packed pages (any order; pass a sorted tuple so the
    cache hits: the plan depends on the multiset only) on ``slots`` resident CTAs: the ``pps`` minimizing
    ``waves x (pps + 1)`` over the CTAs that have pages, fewer splits on ties. The split count is capped at the
    larger of the equal-lengths plan's (:func:`cuda_num_splits` for the longest) and two waves of the whole grid, which
    bounds the partial buffers (``B x ns x H x 2 KB``). Equal lengths: never a worse cost than :func:`cuda_num_splits`.
    """
    if head_groups < 1 or any(p < 0 for p in pages):
        raise ValueError(f"split_plan needs head_groups >= 1 and page counts >= 0, got {head_groups}, {pages}")
    longest = max(pages, default=0)
    if longest <= 1:
        return 1
    slots = max(1, slots)
    cap = max(cuda_num_splits(len(pages), head_groups, longest, slots),
              -(-2 * slots // (len(pages) * head_groups)))  # fmt: skip
    best, best_cost, last_pps = 1, float("inf"), 0
    for ns in range(1, min(cap, longest) + 1):
        pps = -(-longest // ns)
        if pps == last_pps:  # (the same plan as the ns before: pps only shrinks)
            continue
        last_pps = pps
        cost = _cost(pages, head_groups, slots, pps)
        if cost < best_cost:
            best, best_cost = -(-longest // pps), cost
    return best
