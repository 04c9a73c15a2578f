"""Attention kernels over the paged, packed MLA cache: Triton fast paths beside fp32 torch references.

- :mod:`quantmla.kernels.layout`: the byte layout of a page (documented byte by byte), :class:`PagedLayout`
- :mod:`quantmla.kernels.paged`: :class:`PagedMLACache` (pool, block table, BF16 buffers; torch writer and reader)
- :mod:`quantmla.kernels.pages`: page bookkeeping (free list, block table), shareable by several caches
- :mod:`quantmla.kernels.reference`: fp32 torch decode / chunked-prefill attention (the oracles)
- :mod:`quantmla.kernels.prefill`: chunked prefill for GPUs (BF16 workspace + torch's fused attention)
- :mod:`quantmla.kernels.triton_writer`: fused quantize + pack + BF16-buffer writer (Triton)
- :mod:`quantmla.kernels.triton_decode`: split-K decode attention + LSE combine (Triton)
- :mod:`quantmla.kernels.dispatch`: ``decode_attention(..., impl="auto"|"triton"|"torch")`` and overrides

Importing this package does not import Triton or touch CUDA; the Triton modules load on first use.
"""

from quantmla.kernels.dispatch import decode_attention, force_impl, prefill_attention
from quantmla.kernels.paged import PagedLayout, PagedMLACache
from quantmla.kernels.reference import decode_attention_torch, prefill_attention_torch

__all__ = [
    "PagedLayout",
    "PagedMLACache",
    "decode_attention",
    "decode_attention_torch",
    "force_impl",
    "prefill_attention",
    "prefill_attention_torch",
]
