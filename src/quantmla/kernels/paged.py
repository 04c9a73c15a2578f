"""The paged packed MLA cache as the kernels see it: page pool, block table, BF16 sink/local buffers.

Every token of every sequence gets a packed copy in a fixed-size *page* of ``P`` tokens (``P =
CachePolicy.page_size``, 64 by default); a sequence's pages are listed in its row of the block table.
Under the mixed-precision policy the first ``sink`` tokens are also kept in a BF16 sink buffer and the
last ``local`` tokens in a BF16 ring buffer (slot = position % local); attention reads those tokens
from BF16 and all others from their packed copy. The BF16 format has no buffers: its pages hold BF16.
The bytes of one page are documented in :mod:`quantmla.kernels.layout` (:class:`PagedLayout` and
:func:`buffer_slots` live there and are importable from here too).

:class:`PagedMLACache` owns these tensors, allocates pages from a free list, and writes tokens either
with the pure-torch :meth:`PagedMLACache.write_reference` (built on :func:`quantize_codes` and
:func:`pack`, the definition every kernel matches bit for bit) or the fused Triton writer.
"""

from __future__ import annotations

import math

import torch

from quantmla.kernels.layout import PagedLayout, buffer_slots
from quantmla.kernels.pages import PageTable
from quantmla.quant.formats import CacheFormat, CachePolicy, get_format
from quantmla.quant.packing import pack, unpack
from quantmla.quant.quantize import dequantize_codes, quantize_codes
from quantmla.quant.rounding import RopeRounding, quantize_codes_feedback

__all__ = ["PagedLayout", "PagedMLACache", "buffer_slots"]


class PagedMLACache:
    """One layer's paged MLA cache for a batch of ``batch`` sequences.

    Tensors (all on ``device``):
      ``pool``        uint8 ``[num_pages, page_bytes]`` (see :class:`PagedLayout`)
      ``block_table`` int32 ``[batch, max_pages]``; entries past a sequence's pages point at ``pad_page``
      ``seq_lens``    int32 ``[batch]``
      ``sink``        bf16 ``[batch, n_sink, Dc + Dr]`` (quantized formats only, else 0 slots)
      ``local``       bf16 ``[batch, n_local, Dc + Dr]`` (ring: slot = position % n_local)

    ``n_sink``/``n_local`` are the policy's sizes capped at ``max_seq_len`` (:func:`buffer_slots`): attention
    reads the same tokens from BF16 either way, and ``CachePolicy(sink=10**9)`` allocates no more than the
    cache can hold. Page bookkeeping lives in a :class:`~quantmla.kernels.pages.PageTable` (``table``).

    ``shuffle`` draws pages from the free list in random order (hostile tests); ``fill_byte`` initializes
    pool and buffers (0xFF makes every unwritten scale/BF16 value NaN). ``pad_page`` (default 0) is
    where unused block-table entries point.
    """

    def __init__(
        self,
        fmt: CacheFormat | str,
        batch: int,
        max_seq_len: int,
        *,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        policy: CachePolicy | None = None,
        num_pages: int | None = None,
        device: torch.device | str = "cpu",
        shuffle: bool = False,
        seed: int = 0,
        fill_byte: int = 0,
        pad_page: int = 0,
    ) -> None:
        fmt = get_format(fmt)
        fmt = fmt.adapted(kv_lora_rank, rope_dim) if hasattr(fmt, "adapted") else fmt
        policy = policy or CachePolicy()
        layout = PagedLayout(fmt, kv_lora_rank, rope_dim, policy.page_size)
        if batch < 0 or max_seq_len < 0:
            raise ValueError(f"batch and max_seq_len must be >= 0, got {batch} and {max_seq_len}")
        device = torch.device(device)
        max_pages = max(1, math.ceil(max_seq_len / policy.page_size))
        if num_pages is None:
            num_pages = batch * max_pages
        table = PageTable(batch, max_pages, num_pages, device=device, pad_page=pad_page, shuffle=shuffle, seed=seed)
        pool = torch.full((num_pages, layout.page_bytes), fill_byte, dtype=torch.uint8, device=device)
        n_sink, n_local = buffer_slots(fmt, policy, max_seq_len)
        d = kv_lora_rank + rope_dim
        sink = torch.zeros(batch, n_sink, d, dtype=torch.bfloat16, device=device)
        local = torch.zeros(batch, n_local, d, dtype=torch.bfloat16, device=device)
        if fill_byte:
            sink.view(torch.uint8).fill_(fill_byte)
            local.view(torch.uint8).fill_(fill_byte)
        self._bind(layout, policy, table, pool, sink, local, max_seq_len)

    @classmethod
    def on_storage(
        cls,
        layout: PagedLayout,
        policy: CachePolicy,
        table: PageTable,
        pool: torch.Tensor,
        sink: torch.Tensor,
        local: torch.Tensor,
        *,
        max_seq_len: int,
    ) -> PagedMLACache:
        """A cache over storage its caller owns, e.g. one layer of a model-wide cache whose layers share one
        :class:`PageTable` (one block table) and slices of one pool allocation.

        ``pool`` uint8 ``[table.num_pages, layout.page_bytes]``; ``sink``/``local`` bf16 ``[batch, slots, Dc + Dr]``
        (:func:`buffer_slots` slots). The owner may later replace ``pool`` (more pages, same layout), ``sink`` and
        ``local`` (more slots, same positions) and raise ``max_seq_len`` between calls."""
        self = cls.__new__(cls)
        self._bind(layout, policy, table, pool, sink, local, max_seq_len)
        return self

    @classmethod
    def on_pages(
        cls,
        layout: PagedLayout,
        policy: CachePolicy,
        pool: torch.Tensor,
        block_table: torch.Tensor,
        pages: list[list[int]],
        lens: list[int],
        sink: torch.Tensor,
        local: torch.Tensor,
    ) -> PagedMLACache:
        """A cache over pages, block table and BF16 buffers that a serving engine allocated and assigned.

        ``pool`` uint8 ``[num_pages, layout.page_bytes]``; ``block_table`` int32 ``[batch, max_pages]`` (used as
        is; unused entries point at page 0); ``pages[b]`` the pages of sequence ``b`` in token order, enough for
        every length it will be written to; ``lens[b]`` its current length; ``sink``/``local`` bf16
        ``[batch, slots, Dc + Dr]`` (0 slots for the BF16 format). Nothing is allocated or copied; writes that
        need a page not in ``pages`` fail (the engine hands out pages)."""
        table = PageTable.assigned(block_table, pages, pool.shape[0])
        self = cls.on_storage(layout, policy, table, pool, sink, local,
                              max_seq_len=block_table.shape[1] * layout.page_size)  # fmt: skip
        if len(lens) != table.batch or any(n < 0 or n > len(p) * layout.page_size for n, p in zip(lens, pages)):
            raise ValueError(f"lens {list(lens)} must be one length per sequence, covered by its pages")
        self._commit([0] * table.batch, [int(n) for n in lens])
        return self

    def _bind(self, layout, policy, table, pool, sink, local, max_seq_len: int) -> None:
        d = layout.kv_lora_rank + layout.rope_dim
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != layout.page_bytes:
            raise ValueError(f"pool must be uint8 [pages, {layout.page_bytes}], got {pool.dtype} {list(pool.shape)}")
        for name, t in (("sink", sink), ("local", local)):
            if t.dtype != torch.bfloat16 or t.dim() != 3 or t.shape[0] != table.batch or t.shape[2] != d:
                raise ValueError(f"{name} must be bf16 [{table.batch}, slots, {d}], got {t.dtype} {list(t.shape)}")
        self.layout, self.fmt, self.policy, self.table = layout, layout.fmt, policy, table
        self.device = pool.device
        self.max_seq_len = max_seq_len
        self.pool, self.sink, self.local = pool, sink, local
        self.seq_lens = torch.zeros(table.batch, dtype=torch.int32, device=self.device)
        self._lens = [0] * table.batch  # host mirror of seq_lens
        # decode kernels plan their splits for sequences this long (None: the longest now); a captured decode step
        # (quantmla.cache.graph) sets it to the capacity, so one captured launch covers every later length
        self.planned_length: int | None = None
        # query-aware rounding of the RoPE key (quantmla.quant.rounding): None = round to nearest
        self.rope_rounding: RopeRounding | None = None

    def set_rope_rounding(self, plan: RopeRounding | None) -> None:
        """Round the RoPE key of every later write with ``plan`` (None: round to nearest). Same bytes, same
        readers; a plan for another RoPE width, or for a cache whose RoPE key is not quantized, is an error."""
        if plan is not None:
            if not isinstance(plan, RopeRounding):
                raise TypeError(f"rope rounding must be a RopeRounding (quantmla.quant.rounding), got {type(plan)}")
            if self.fmt.rope is None:
                raise ValueError(f"format {self.fmt.name} stores the RoPE key in BF16: there is nothing to round")
            if plan.width != self.layout.rope_dim:
                raise ValueError(f"a rounding plan for a {plan.width}-channel RoPE key on a cache whose RoPE key "
                                 f"has {self.layout.rope_dim} channels")  # fmt: skip
            plan = plan.to(self.device)
        self.rope_rounding = plan

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.table.batch

    @property
    def block_table(self) -> torch.Tensor:
        return self.table.block_table

    @property
    def num_pages(self) -> int:
        return self.pool.shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.max_pages

    @property
    def pad_page(self) -> int:
        return self.table.pad_page

    @property
    def kv_lora_rank(self) -> int:
        return self.layout.kv_lora_rank

    @property
    def rope_dim(self) -> int:
        return self.layout.rope_dim

    @property
    def page_size(self) -> int:
        return self.policy.page_size

    @property
    def n_sink(self) -> int:
        return self.sink.shape[1]

    @property
    def n_local(self) -> int:
        return self.local.shape[1]

    def lengths(self) -> list[int]:
        """Host copy of the sequence lengths (no device sync)."""
        return list(self._lens)

    def plan_longest(self) -> int:
        """The sequence length the decode kernels plan their splits for: :attr:`planned_length` when set (it must
        cover every sequence: a shorter plan would leave tokens out), else the longest sequence now."""
        longest = max(self._lens, default=0)
        if self.planned_length is None:
            return longest
        if self.planned_length < longest:
            raise ValueError(f"planned_length={self.planned_length} is shorter than a sequence of {longest} tokens")
        return self.planned_length

    def plan_lengths(self) -> list[int]:
        """The sequence lengths the decode kernels plan their splits for: every sequence at :attr:`planned_length`
        when set (a captured step's launch must cover every later length), else the lengths now."""
        longest = self.plan_longest()
        return [longest] * self.batch if self.planned_length is not None else list(self._lens)

    def advance_host(self, n: int) -> None:
        """Add ``n`` tokens to every sequence's host length only: for a replayed decode step, whose captured kernels
        already advanced :attr:`seq_lens` on the device."""
        if any(v + n > self.max_seq_len or v + n < 0 for v in self._lens):
            raise ValueError(f"advancing lengths {self._lens} by {n} leaves [0, max_seq_len={self.max_seq_len}]")
        self._lens = [v + n for v in self._lens]

    def bytes_per_token(self) -> float:
        return self.layout.bytes_per_token()

    def pool_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The pool reinterpreted as ``dtype`` elements: ``[num_pages, page_bytes / itemsize]``."""
        return self.pool.view(dtype)

    def bf16_positions(self, n: int) -> tuple[range, range]:
        """Positions of a length-``n`` sequence read from the sink buffer and from the local ring."""
        if not self.fmt.is_quantized:
            return range(0), range(0)
        s = min(self.n_sink, n)
        return range(s), range(max(s, n - self.n_local), n)

    def packed_range(self, n: int) -> range:
        """Positions of a length-``n`` sequence that attention reads from their packed copy."""
        if not self.fmt.is_quantized:
            return range(n)
        return range(self.n_sink, max(self.n_sink, n - self.n_local))

    # -- allocation -------------------------------------------------------------------------------
    def reserve(self, new_lens: list[int]) -> None:
        """Make sure sequence ``b`` owns enough pages for ``new_lens[b]`` tokens (host-side bookkeeping;
        copies the changed block-table rows to the device)."""
        for b, n in enumerate(new_lens):
            if n > self.max_seq_len:
                raise ValueError(f"sequence {b} would hold {n} tokens, more than max_seq_len={self.max_seq_len}")
        self.table.reserve(list(new_lens), self.page_size)

    def select(self, index) -> None:
        """Keep sequences ``index`` (a list or 1-D tensor of row numbers; repeats allowed, as in beam search)
        of a cache that owns its :class:`PageTable`. Caches sharing a table call ``table.select`` once and then
        :meth:`apply_select` on each of them."""
        index = [int(i) for i in (index.tolist() if torch.is_tensor(index) else index)]
        self.apply_select(index, self.table.select(index))

    def apply_select(self, index: list[int], copies: list[tuple[int, int]]) -> None:
        """This cache's part of ``table.select(index)``: copy pages ``copies`` (source, destination) inside the
        pool, then reorder lengths and BF16 buffers."""
        if copies:
            src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
            self.pool[dst] = self.pool[src]
        idx = torch.tensor(index, dtype=torch.long, device=self.device)
        self.sink, self.local = self.sink[idx], self.local[idx]
        self._lens = [self._lens[i] for i in index]
        self.seq_lens = torch.tensor(self._lens, dtype=torch.int32, device=self.device)

    def _plan_write(self, T: int, n_new) -> tuple[list[int], list[int]]:
        if n_new is None:
            n_new = [T] * self.batch
        elif isinstance(n_new, torch.Tensor):
            n_new = [int(v) for v in n_new.tolist()]
        else:
            n_new = [int(v) for v in n_new]
        if len(n_new) != self.batch or any(v < 0 or v > T for v in n_new):
            raise ValueError(f"n_new must hold {self.batch} counts in [0, {T}], got {n_new}")
        start = list(self._lens)
        self.reserve([s + k for s, k in zip(start, n_new)])
        return start, n_new

    def _commit(self, start: list[int], n_new: list[int]) -> None:
        self._lens = [s + k for s, k in zip(start, n_new)]
        if len(set(n_new)) == 1:  # every decode step: no host-to-device copy (it would synchronize the stream)
            self.seq_lens.add_(n_new[0])
        else:
            self.seq_lens.copy_(torch.tensor(self._lens, dtype=torch.int32))

    def _check_inputs(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        B, Dc, Dr = self.batch, self.kv_lora_rank, self.rope_dim
        if c_kv.dim() != 3 or c_kv.shape[0] != B or c_kv.shape[2] != Dc:
            raise ValueError(f"c_kv must be [B={B}, T, Dc={Dc}], got {list(c_kv.shape)}")
        if k_pe.shape != (B, c_kv.shape[1], Dr):
            raise ValueError(f"k_pe must be [B={B}, T={c_kv.shape[1]}, Dr={Dr}], got {list(k_pe.shape)}")

    # -- the post-RoPE rotation of the rounding plan (RopeRounding.rotation): keys stored rotated, queries read them
    # rotated, keys handed back to the model unrotated; the identity without one ------------------
    def rope_key(self, k_pe: torch.Tensor) -> torch.Tensor:
        """``k_pe [..., Dr]`` in the coordinates the cache stores (every writer and BF16 copy takes it so); as
        ``rope_query``, a query's RoPE part as it must read them (the attention entry points apply it)."""
        return k_pe if self.rope_rounding is None else self.rope_rounding.rotate(k_pe)

    rope_query = rope_key  # keys and queries take the same rotation: (q U) . (k U) = q . k

    def rope_key_out(self, k_pe: torch.Tensor) -> torch.Tensor:
        """A stored (dequantized or BF16) ``k_pe [..., Dr]`` back in the model's coordinates."""
        return k_pe if self.rope_rounding is None else self.rope_rounding.unrotate(k_pe)

    # -- writing ----------------------------------------------------------------------------------
    def write(self, c_kv: torch.Tensor, k_pe: torch.Tensor, n_new=None, *, impl: str = "auto") -> None:
        """Append tokens: ``c_kv [B, T, Dc]``, ``k_pe [B, T, Dr]``; sequence ``b`` takes its first
        ``n_new[b]`` rows (all ``T`` when None). ``impl``: ``"auto"`` (Triton on CUDA), ``"triton"``, ``"torch"``."""
        from quantmla.kernels.dispatch import resolve_impl

        which = resolve_impl(impl, c_kv, self.fmt, kernel="write")
        if which == "torch":
            self.write_reference(c_kv, k_pe, n_new)
        else:
            from quantmla.kernels.triton_writer import write_triton

            self._check_inputs(c_kv, k_pe)
            k_pe = self.rope_key(k_pe)
            start, n_new = self._plan_write(c_kv.shape[1], n_new)
            write_triton(self, c_kv, k_pe, start, n_new)
            self._commit(start, n_new)

    def write_reference(self, c_kv: torch.Tensor, k_pe: torch.Tensor, n_new=None) -> None:
        """Pure-torch writer: ``quantize_codes`` + ``pack`` per path, BF16 copies into sink/local."""
        self._check_inputs(c_kv, k_pe)
        k_pe = self.rope_key(k_pe)
        start, n_new = self._plan_write(c_kv.shape[1], n_new)
        L, P = self.layout, self.page_size
        final = [s + k for s, k in zip(start, n_new)]
        for b in range(self.batch):
            k = n_new[b]
            if k == 0:
                continue
            pos = torch.arange(start[b], final[b])
            pages = torch.tensor(self.table.pages(b), dtype=torch.long)[pos // P].to(self.device)  # [k]
            slots = (pos % P).to(self.device)  # [k]
            for which, x, spec, width in (
                ("content", c_kv[b, :k], self.fmt.content, L.kv_lora_rank),
                ("rope", k_pe[b, :k], self.fmt.rope, L.rope_dim),
            ):
                self._write_path(which, x, spec, width, pages, slots)
            if self.fmt.is_quantized:
                row = torch.cat([c_kv[b, :k], k_pe[b, :k]], dim=-1).to(torch.bfloat16)  # [k, Dc + Dr]
                s_keep = pos < self.n_sink
                if s_keep.any():
                    self.sink[b, pos[s_keep]] = row[s_keep.to(row.device)]
                if self.n_local:
                    l_keep = pos >= final[b] - self.n_local
                    if l_keep.any():
                        self.local[b, pos[l_keep] % self.n_local] = row[l_keep.to(row.device)]
        self._commit(start, n_new)

    def _region(self, which: str, words: bool = False) -> torch.Tensor:
        """Codes region of all pages as uint8 ``[num_pages, P, bytes per token]``; ``words``: as int32 ``[.., bytes /
        4]`` where the page, the region and a token's bytes are 4-byte multiples (else the uint8 view)."""
        L, P = self.layout, self.page_size
        off, nb = (L.content_offset, L.content_bytes) if which == "content" else (L.rope_offset, L.rope_bytes)
        aligned = (self.pool.shape[1] | self.pool.stride(0) | off | nb | self.pool.storage_offset()) % 4 == 0
        if words and aligned and self.pool.stride(1) == 1:
            pool = self.pool.view(torch.int32)
            return pool[:, off // 4 : (off + P * nb) // 4].view(self.num_pages, P, nb // 4)
        return self.pool[:, off : off + P * nb].view(self.num_pages, P, nb)

    def _meta(self) -> torch.Tensor:
        """Meta region of all pages as fp16 ``[num_pages, M, P]``."""
        L, P = self.layout, self.page_size
        m = self.pool[:, L.meta_offset : L.meta_offset + L.meta_rows * P * 2]
        return m.view(torch.float16).view(self.num_pages, L.meta_rows, P)

    def _meta_rows_of(self, which: str) -> tuple[int, int | None, int]:
        """(first scale row, first offset row or None, number of groups)."""
        L = self.layout
        spec, width = (self.fmt.content, L.kv_lora_rank) if which == "content" else (self.fmt.rope, L.rope_dim)
        g = spec.num_groups(width)
        if which == "content":
            return L.content_scale_row, None if spec.symmetric else L.content_offset_row, g
        return L.rope_scale_row, None if spec.symmetric else L.rope_offset_row, g

    def _write_path(self, which, x, spec, width, pages, slots) -> None:
        region = self._region(which)
        if spec is None:  # BF16 path: the bytes of the bf16 values
            region[pages, slots] = x.to(torch.bfloat16).contiguous().view(torch.uint8)
            return
        if spec.scale_dtype != "fp16":
            raise NotImplementedError("the paged layout stores fp16 scales; QuantSpec.scale_dtype must be 'fp16'")
        if which == "rope" and self.rope_rounding is not None:
            codes, scale, offset = quantize_codes_feedback(x, spec, self.rope_rounding)
        else:
            codes, scale, offset = quantize_codes(x, spec)  # [k, D] uint8, [k, G], [k, G]
        region[pages, slots] = pack(codes, spec.bits, self.layout.pack_group(which))
        meta = self._meta()
        r_s, r_o, g = self._meta_rows_of(which)
        rows = torch.arange(g, device=self.device)
        meta[pages[:, None], (r_s + rows)[None, :], slots[:, None]] = scale
        if r_o is not None:
            meta[pages[:, None], (r_o + rows)[None, :], slots[:, None]] = offset

    # -- reading (torch; used by the reference attention and the tests) ---------------------------
    def read_packed(self, b: int, pos: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[len(pos), Dc + Dr]`` in ``dtype``: tokens ``pos`` of sequence ``b`` dequantized from their packed copy
        (computed in fp32, rounded to ``dtype`` once; a BF16 path's bytes read 4 at a time where they align)."""
        L, P = self.layout, self.page_size
        pos = pos.to(torch.long).cpu()
        pages = torch.tensor(self.table.pages(b), dtype=torch.long)[pos // P].to(self.device)
        slots = (pos % P).to(self.device)
        out = []
        for which, spec, width in (("content", self.fmt.content, L.kv_lora_rank), ("rope", self.fmt.rope, L.rope_dim)):
            if spec is None:  # BF16 values: gather whole words, not bytes
                out.append(self._region(which, words=True)[pages, slots].contiguous().view(torch.bfloat16).to(dtype))
                continue
            raw = self._region(which)[pages, slots]  # [k, bytes]
            codes = unpack(raw, spec.bits, width, self.layout.pack_group(which))
            meta = self._meta()
            r_s, r_o, g = self._meta_rows_of(which)
            rows = torch.arange(g, device=self.device)
            scale = meta[pages[:, None], (r_s + rows)[None, :], slots[:, None]]
            offset = None if r_o is None else meta[pages[:, None], (r_o + rows)[None, :], slots[:, None]]
            out.append(dequantize_codes(codes, scale, offset, spec).to(dtype))
        return torch.cat(out, dim=-1)

    def recent_window(self, c_kv: torch.Tensor, k_pe: torch.Tensor, before: list[int], n_new: list[int]):
        """The ``recent`` argument of prefill attention for a write of ``c_kv [B, T, Dc]``, ``k_pe [B, T, Dr]``
        (sequence ``b`` takes its first ``n_new[b]`` rows) onto lengths ``before``: BF16 ``[B, W, Dc + Dr]``,
        ``W = n_local - 1 + T``, row ``b`` = the copies of its last ``W`` positions after the write (the local ring
        as it was before it, then the new tokens), right-aligned. Call it before the write overwrites the ring."""
        B, T = c_kv.shape[:2]
        nl = self.n_local
        W = nl - 1 + T
        recent = torch.zeros(B, W, c_kv.shape[-1] + k_pe.shape[-1], dtype=torch.bfloat16, device=c_kv.device)
        for b in range(B):
            n, k = before[b], n_new[b]
            lo = max(0, n - (nl - 1))
            if lo < n:
                pos = torch.arange(lo, n, device=self.device)
                recent[b, W - k - (n - lo) : W - k] = self.local[b, pos % nl].to(c_kv.device)
            recent[b, W - k :] = torch.cat([c_kv[b, :k], self.rope_key(k_pe[b, :k])], dim=-1).to(torch.bfloat16)
        return recent

    def read_tokens(self, b: int, n: int | None = None) -> torch.Tensor:
        """fp32 ``[n, Dc + Dr]``: what attention sees for sequence ``b`` (BF16 for sink/local positions,
        dequantized packed copies for the rest; the RoPE key as stored: :meth:`rope_key_out` turns it back). ``n``
        defaults to the stored length."""
        n = self._lens[b] if n is None else n
        out = torch.empty(n, self.kv_lora_rank + self.rope_dim, dtype=torch.float32, device=self.device)
        packed = self.packed_range(n)
        if len(packed):
            out[packed.start : packed.stop] = self.read_packed(b, torch.arange(packed.start, packed.stop))
        sink, local = self.bf16_positions(n)
        if len(sink):
            out[: sink.stop] = self.sink[b, : sink.stop].float()
        if len(local):
            pos = torch.arange(local.start, local.stop)
            out[local.start : local.stop] = self.local[b, (pos % self.n_local).to(self.device)].float()
        return out
