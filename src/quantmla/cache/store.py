"""Every layer of a model's MLA cache in the paged layout: one block table, one pool allocation, BF16 buffers.

The store holds, for a batch of sequences:

* one :class:`~quantmla.kernels.pages.PageTable` (block table ``[B, max_pages]`` int32) shared by all layers: a
  page id names the same ``page_size`` token slots in every layer;
* one uint8 allocation sliced into per-layer pools ``[num_pages, page_bytes_l]`` (layer ``l``'s format sets its
  page bytes, so layers may use different formats);
* per layer, the BF16 sink and local-window buffers of a quantized format and an int32 length per sequence.

Layer ``l`` is seen through :meth:`PagedStore.layer`, a :class:`~quantmla.kernels.paged.PagedMLACache` over
that storage: the object the fused writer, the decode kernels and the torch references take. The store never
touches page bytes itself; it only allocates, grows and copies whole pages.

Capacity: with ``max_length`` the store allocates ``batch x ceil(max_length / page_size)`` pages at the first
write and refuses to grow (a longer sequence is a clear error). Without it the pool grows on demand by at least
a quarter (amortized O(1) per token; the spare pages are reported), the block table widens, and the sink/local
buffers grow with the capacity up to the policy's sizes (so ``CachePolicy(sink=10**9)`` never allocates more
than the tokens the cache can hold). Growing copies the old pool into a new one (transiently both exist).
"""

from __future__ import annotations

import math

import torch

from quantmla.kernels.paged import PagedLayout, PagedMLACache, buffer_slots
from quantmla.kernels.pages import PageTable
from quantmla.quant.formats import CacheFormat, CachePolicy

GROWTH = 1.25  # a growable pool or block table grows to at least this factor times its size


class PagedStore:
    """Paged storage of ``len(formats)`` layers (one :class:`CacheFormat` each) with latent width
    ``kv_lora_rank`` and RoPE width ``rope_dim``. Empty until :meth:`start` fixes batch, device."""

    def __init__(
        self,
        formats: list[CacheFormat],
        kv_lora_rank: int,
        rope_dim: int,
        policy: CachePolicy,
        *,
        max_length: int | None = None,
        rope_rounding: list | None = None,
    ) -> None:
        if not formats:
            raise ValueError("a cache needs at least one layer")
        if rope_rounding is not None and len(rope_rounding) != len(formats):
            raise ValueError(f"rope_rounding needs one plan (or None) per layer: {len(formats)} layers, got "
                             f"{len(rope_rounding)}")  # fmt: skip
        # per layer, the RoPE key's query-aware rounding plan (quantmla.quant.rounding) or None (round to nearest);
        # each layer's view checks its plan (PagedMLACache.set_rope_rounding) when the storage starts
        self.rope_rounding = list(rope_rounding) if rope_rounding is not None else [None] * len(formats)
        self.policy = policy
        self.layouts = [PagedLayout(f, kv_lora_rank, rope_dim, policy.page_size) for f in formats]
        self.max_length = max_length
        self.table: PageTable | None = None
        self.views: list[PagedMLACache] = []
        self.flat: torch.Tensor | None = None  # the one pool allocation, uint8 [sum_l num_pages * page_bytes_l]
        self.pads: list[int] = []  # per sequence: leading padding positions of the caller's key axis, not stored
        self.dtype: torch.dtype | None = None  # dtype of the activations written (checked on every write)
        self.mask_memo: tuple | None = None  # the last attention-mask check's answer (PagedCacheLayer._pads_and_causal)
        self.mask_checks = 0  # attention-mask checks run in full (one per forward when every layer gets one mask)

    # -- life cycle -------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.table is not None

    @property
    def batch(self) -> int:
        return 0 if self.table is None else self.table.batch

    @property
    def device(self) -> torch.device | None:
        return None if self.table is None else self.table.device

    def start(self, batch: int, device: torch.device, first_tokens: int) -> None:
        """Allocate for ``batch`` sequences on ``device``, with room for ``first_tokens`` tokens each (or for
        ``max_length`` when set)."""
        P = self.policy.page_size
        want = self.max_length if self.max_length is not None else max(first_tokens, 1)
        max_pages = max(1, math.ceil(want / P))
        self.table = PageTable(batch, max_pages, batch * max_pages, device=device)
        self.flat = None
        self.views = []
        self.pads = [0] * batch
        pools = self._pools(self._alloc(self.table.num_pages, device), self.table.num_pages)
        cap = self._capacity()
        for layout, pool, plan in zip(self.layouts, pools, self.rope_rounding):
            n_sink, n_local = buffer_slots(layout.fmt, self.policy, cap)
            d = layout.kv_lora_rank + layout.rope_dim
            sink = torch.zeros(batch, n_sink, d, dtype=torch.bfloat16, device=device)
            local = torch.zeros(batch, n_local, d, dtype=torch.bfloat16, device=device)
            view = PagedMLACache.on_storage(layout, self.policy, self.table, pool, sink, local, max_seq_len=cap)
            if plan is not None and layout.fmt.rope is not None:  # a BF16 RoPE key (e.g. a BF16 layer) needs none
                view.set_rope_rounding(plan)
            self.views.append(view)

    def _capacity(self) -> int:
        """Tokens per sequence the store can hold now: ``max_length``, else the block table's pages."""
        return self.max_length if self.max_length is not None else self.table.max_pages * self.policy.page_size

    def reset(self) -> None:
        """Forget every sequence and free the storage (the next write starts again)."""
        self.table, self.flat, self.views, self.pads, self.dtype = None, None, [], [], None

    def layer(self, idx: int) -> PagedMLACache:
        """Layer ``idx``'s cache (the kernels' view); only after :meth:`start`."""
        return self.views[idx]

    # -- storage ----------------------------------------------------------------------------------
    def _alloc(self, num_pages: int, device) -> torch.Tensor:
        self.flat = torch.zeros(num_pages * sum(L.page_bytes for L in self.layouts), dtype=torch.uint8, device=device)
        return self.flat

    def _pools(self, flat: torch.Tensor, num_pages: int) -> list[torch.Tensor]:
        out, off = [], 0
        for L in self.layouts:
            n = num_pages * L.page_bytes
            out.append(flat[off : off + n].view(num_pages, L.page_bytes))
            off += n
        return out

    def prepare(self, new_lengths: list[int]) -> None:
        """Make room for every layer to hold ``new_lengths[b]`` tokens in sequence ``b``: widen the block table,
        grow the pool and the BF16 buffers (growable stores), or raise a clear error past ``max_length``."""
        P = self.policy.page_size
        longest = max(new_lengths, default=0)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(
                f"the cache holds at most max_length={self.max_length} tokens per sequence; this write would make "
                f"one {longest} tokens long (create the cache with a larger max_length)"
            )
        if math.ceil(longest / P) > self.table.max_pages:
            self._widen(max(math.ceil(longest / P), math.ceil(self.table.max_pages * GROWTH)))
        short = self.table.pages_missing(new_lengths, P) - self.table.free_pages
        if short > 0:
            self._grow(short)

    def _widen(self, max_pages: int) -> None:
        self.table.widen(max_pages)
        cap = self._capacity()
        for v in self.views:
            v.max_seq_len = cap
            n_sink, n_local = buffer_slots(v.fmt, self.policy, cap)
            v.sink = _grown(v.sink, n_sink)  # positions keep their slots: pos < old slots (see module doc)
            v.local = _grown(v.local, n_local)

    def _grow(self, short: int) -> None:
        """At least ``short`` more pages (a fixed ``max_length`` bounds sequences, not the batch: beam search may
        need more pages than the first batch did)."""
        old_n = self.table.num_pages
        new_n = max(old_n + short, math.ceil(old_n * GROWTH))
        old = [v.pool for v in self.views]
        pools = self._pools(self._alloc(new_n, self.device), new_n)
        for v, o, p in zip(self.views, old, pools):
            p[:old_n] = o
            v.pool = p
        self.table.add_pages(new_n - old_n)

    def select(self, index: list[int]) -> None:
        """Keep sequences ``index`` (repeats allowed: beam search), in every layer."""
        short = self.table.pages_short_for_select(index)
        if short > 0:
            self._grow(short)
        copies = self.table.select(index)
        for v in self.views:
            v.apply_select(index, copies)
        self.pads = [self.pads[i] for i in index]

    # -- accounting -------------------------------------------------------------------------------
    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the store holds, by component."""
        if self.table is None:
            return {}
        return {
            "pool": [self.flat],
            "block_table": [self.table.block_table],
            "seq_lens": [v.seq_lens for v in self.views],
            "sink": [v.sink for v in self.views],
            "local": [v.local for v in self.views],
        }

    def used_pool_bytes(self) -> int:
        """Pool bytes of the pages sequences own (the rest of the pool is spare capacity)."""
        if self.table is None:
            return 0
        pages = sum(len(self.table.pages(b)) for b in range(self.batch))
        return pages * sum(L.page_bytes for L in self.layouts)


def _grown(buf: torch.Tensor, slots: int) -> torch.Tensor:
    """``buf [B, s, D]`` with ``slots >= s`` slots, the first ``s`` copied."""
    if slots <= buf.shape[1]:
        return buf
    out = torch.zeros(buf.shape[0], slots, buf.shape[2], dtype=buf.dtype, device=buf.device)
    out[:, : buf.shape[1]] = buf
    return out
