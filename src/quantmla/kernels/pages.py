"""Page bookkeeping of a paged cache: which pages each sequence owns, the free list and the block table.

A :class:`PageTable` hands out page ids; a page id names the same ``page_size`` token slots in every pool that
uses the table (one layer's :class:`~quantmla.kernels.paged.PagedMLACache`, or every layer of a model's cache
sharing one table). It knows nothing about bytes: pools live with their owners, who grow them when the table
gains pages (:meth:`PageTable.add_pages`) and copy pages when :meth:`PageTable.select` asks for it.

Tensors: ``block_table`` int32 ``[batch, max_pages]`` on ``device``; row ``b`` lists sequence ``b``'s pages in
order, entries past them hold ``pad_page``. The host keeps the same lists (no device sync to plan a write).
"""

from __future__ import annotations

import math

import torch


class PageTable:
    """Pages of ``batch`` sequences out of ``num_pages``; at most ``max_pages`` per sequence.

    ``shuffle`` hands pages out in a random order (hostile tests); ``pad_page`` is where unused block-table
    entries point."""

    def __init__(
        self,
        batch: int,
        max_pages: int,
        num_pages: int,
        *,
        device: torch.device | str = "cpu",
        pad_page: int = 0,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if batch < 0 or max_pages < 1 or num_pages < 0:
            raise ValueError(f"need batch >= 0, max_pages >= 1, num_pages >= 0; got {batch}, {max_pages}, {num_pages}")
        self.device = torch.device(device)
        self.num_pages = num_pages
        self.pad_page = pad_page
        self.block_table = torch.full((batch, max_pages), pad_page, dtype=torch.int32, device=self.device)
        order = list(range(num_pages))
        if shuffle:
            g = torch.Generator().manual_seed(seed)
            order = [order[i] for i in torch.randperm(num_pages, generator=g).tolist()]
        self._free = order[::-1]  # pop() from the end hands out pages in `order`
        self._pages: list[list[int]] = [[] for _ in range(batch)]

    @classmethod
    def assigned(cls, block_table: torch.Tensor, pages: list[list[int]], num_pages: int, *, pad_page: int = 0):
        """A table whose pages someone else handed out (a serving engine's block manager): ``block_table`` int32
        ``[batch, max_pages]`` is used as is (not copied), ``pages[b]`` lists the pages of sequence ``b`` in token
        order (the first entries of its block-table row). The free list is empty: :meth:`reserve` succeeds only
        for lengths the assigned pages already cover."""
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or len(pages) != block_table.shape[0]:
            raise ValueError(
                f"block_table must be int32 [batch={len(pages)}, max_pages], got {block_table.dtype} "
                f"{list(block_table.shape)}"
            )
        if any(len(p) > block_table.shape[1] for p in pages):
            raise ValueError(f"a sequence lists more pages than the block table's {block_table.shape[1]} columns")
        self = cls(0, 1, 0, device=block_table.device, pad_page=pad_page)
        self.num_pages, self.block_table = num_pages, block_table
        self._pages = [list(p) for p in pages]
        return self

    # -- queries ----------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self._pages)

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages(self, b: int) -> list[int]:
        """Sequence ``b``'s pages, in token order (do not modify)."""
        return self._pages[b]

    def pages_missing(self, tokens: list[int], page_size: int) -> int:
        """How many pages :meth:`reserve` would take from the free list for these per-sequence token counts."""
        return sum(max(0, math.ceil(n / page_size) - len(p)) for n, p in zip(tokens, self._pages))

    # -- changes ----------------------------------------------------------------------------------
    def reserve(self, tokens: list[int], page_size: int) -> None:
        """Make sequence ``b`` own enough pages for ``tokens[b]`` tokens (copies changed rows to the device).

        Raises ``ValueError`` past ``max_pages`` pages per sequence and ``RuntimeError`` when the free list runs
        out; in both cases nothing is allocated."""
        if len(tokens) != self.batch:
            raise ValueError(f"need one token count per sequence ({self.batch}), got {len(tokens)}")
        for b, n in enumerate(tokens):
            if math.ceil(n / page_size) > self.max_pages:
                raise ValueError(
                    f"sequence {b} would hold {n} tokens, more than {self.max_pages} pages of {page_size} tokens"
                )
        missing = self.pages_missing(tokens, page_size)
        if missing > len(self._free):
            raise RuntimeError(
                f"out of cache pages ({self.num_pages} allocated, {len(self._free)} free, {missing} needed); "
                "create the cache with more num_pages"
            )
        if not missing:
            return
        for b, n in enumerate(tokens):
            while len(self._pages[b]) < math.ceil(n / page_size):
                self._pages[b].append(self._free.pop())
        self._sync()

    def add_pages(self, n: int) -> None:
        """``n`` new page ids ``num_pages .. num_pages + n - 1`` (the pools' owners grow the pools to match)."""
        new = list(range(self.num_pages, self.num_pages + n))
        self._free = new[::-1] + self._free  # handed out after the pages already free, in id order
        self.num_pages += n

    def widen(self, max_pages: int) -> None:
        """Allow up to ``max_pages`` pages per sequence (a wider block table)."""
        if max_pages > self.max_pages:
            self.block_table = torch.full((self.batch, max_pages), self.pad_page, dtype=torch.int32, device=self.device)
            self._sync()

    def pages_short_for_select(self, index: list[int]) -> int:
        """How many pages the free list lacks for :meth:`select` with ``index`` (0 when it can go ahead)."""
        need = sum(len(self._pages[i]) for k, i in enumerate(index) if i in index[:k])  # copies of repeated rows
        freed = sum(len(p) for b, p in enumerate(self._pages) if b not in set(index))
        return max(0, need - freed - len(self._free))

    def select(self, index: list[int]) -> list[tuple[int, int]]:
        """New sequence ``i`` = old sequence ``index[i]`` (repeats allowed, as in beam search).

        The first new row that takes an old row keeps its pages; every further one gets fresh pages. Returns the
        ``(source, destination)`` page copies every pool must make before anything else is written. Pages of
        dropped rows go back to the free list (first, so copies may reuse them)."""
        if any(not 0 <= i < self.batch for i in index):
            raise IndexError(f"row index out of range for batch {self.batch}: {index}")
        short = self.pages_short_for_select(index)
        if short:
            raise RuntimeError(f"out of cache pages: selecting rows {index} needs {short} more pages")
        kept = set(index)
        for b, p in enumerate(self._pages):
            if b not in kept:
                self._free.extend(reversed(p))
        copies: list[tuple[int, int]] = []
        used: set[int] = set()
        new_pages: list[list[int]] = []
        for i in index:
            if i not in used:
                used.add(i)
                new_pages.append(self._pages[i])
                continue
            dst = [self._free.pop() for _ in self._pages[i]]
            copies.extend(zip(self._pages[i], dst))
            new_pages.append(dst)
        self._pages = [list(p) for p in new_pages]
        self.block_table = torch.full((len(index), self.max_pages), self.pad_page, dtype=torch.int32,
                                      device=self.device)  # fmt: skip
        self._sync()
        return copies

    def _sync(self) -> None:
        bt = torch.full((self.batch, self.max_pages), self.pad_page, dtype=torch.int32)
        for b, pages in enumerate(self._pages):
            if pages:
                bt[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table.copy_(bt)
