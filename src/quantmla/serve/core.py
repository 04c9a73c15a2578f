"""The vLLM-free core of the serving backend: write, decode and gather on tensors shaped as vLLM passes them.

vLLM owns the pages (one tensor per layer, ``[num_blocks, ...]`` holding ``page_bytes`` per block), the block
table ``[B, max_blocks]`` int32, the token -> slot mapping and the per-step lengths; we own the per-request
BF16 sink/local copies (:class:`~quantmla.serve.request_state.RequestStateTable`). :class:`ServeLayer` binds
these to a :class:`~quantmla.kernels.paged.PagedMLACache` view (no copy) and calls the kernels' own entry
points: ``write`` (the torch reference ``write_reference``, or the fused Triton writer, bit-identical),
``decode_attention`` and, for prefill and context, ``read_tokens`` (the dequantizing gather) with
``prefill_attention``. The byte order inside a page is never decoded here.

Flat (vLLM) shapes: ``c_kv [N, Dc]``, ``k_pe [N, Dr]`` for the ``N`` tokens of a step, rows ``b`` owning
``query_start_loc[b] : query_start_loc[b + 1]``; ``seq_lens [B]`` = lengths *after* the step's tokens.
"""

from __future__ import annotations

import math

import torch

from quantmla.kernels.dispatch import decode_attention, resolve_impl
from quantmla.kernels.paged import PagedLayout, PagedMLACache
from quantmla.kernels.reference import prefill_attention_torch
from quantmla.quant.formats import CachePolicy
from quantmla.serve.request_state import RequestStateTable


class PagedView(PagedMLACache):
    """A :class:`PagedMLACache` over pages, block table and BF16 buffers that someone else allocated.

    It owns nothing and allocates nothing: ``pool`` is the engine's page tensor (uint8 ``[num_blocks,
    page_bytes]`` view), ``pages[b]`` the blocks of row ``b`` (enough for its length after the step),
    ``lens[b]`` its length before the step's writes. (It fills the same fields ``PagedMLACache.__init__`` does;
    tests/serve/test_core.py checks it against a cache built the ordinary way, bit for bit.)"""

    def __init__(self, layout: PagedLayout, pool, block_table, pages, lens, sink, local) -> None:  # noqa: D107
        self.fmt, self.layout = layout.fmt, layout
        self.policy = CachePolicy(sink=sink.shape[1], local=local.shape[1], page_size=layout.page_size)
        self.batch = block_table.shape[0]
        self.device = pool.device
        self.max_pages = block_table.shape[1]
        self.max_seq_len = self.max_pages * layout.page_size
        self.num_pages = pool.shape[0]
        self.pool, self.pad_page = pool, 0
        self.block_table = block_table
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=pool.device)
        self.sink, self.local = sink, local
        self._free: list[int] = []
        self._pages = [list(p) for p in pages]
        self._lens = list(lens)


class ServeLayer:
    """One attention layer's view of the serving cache (format, geometry, which kernels)."""

    def __init__(self, layout: PagedLayout, layer: int, *, impl: str = "auto", check_slots: bool = True) -> None:
        self.layout, self.layer, self.impl, self.check_slots = layout, layer, impl, check_slots

    @property
    def quantized(self) -> bool:
        return self.layout.fmt.is_quantized

    # -- binding --------------------------------------------------------------------------------------
    def pool(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's layer tensor (any dtype, ``[num_blocks, ...]``) as uint8 ``[num_blocks, page_bytes]``."""
        raw = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
        per_block = raw[0].numel() if raw.shape[0] else 0
        if raw.shape[0] and per_block < self.layout.page_bytes:
            raise ValueError(
                f"a KV cache block holds {per_block} bytes, the {self.layout.fmt.name} page needs "
                f"{self.layout.page_bytes}: the KV cache spec does not report quantmla's page size"
            )
        flat = raw.reshape(raw.shape[0], -1)
        return flat[:, : self.layout.page_bytes]

    def view(self, kv_cache, state: RequestStateTable | None, block_table, lens_before, lens_after) -> PagedView:
        P = self.layout.page_size
        bt_host = block_table.cpu()
        pages = [bt_host[b, : math.ceil(n / P)].tolist() for b, n in enumerate(lens_after)]
        B = block_table.shape[0]
        if self.quantized:
            if state is None:
                raise ValueError(f"format {self.layout.fmt.name} needs the per-request BF16 sink/local state")
            sink, local = state.batch_views(self.layer, B)
        else:
            d = self.layout.kv_lora_rank + self.layout.rope_dim
            sink = local = torch.empty(B, 0, d, dtype=torch.bfloat16, device=kv_cache.device)
        return PagedView(self.layout, self.pool(kv_cache), block_table.to(torch.int32).contiguous(), pages,
                         lens_before, sink, local)

    # -- the three operations -----------------------------------------------------------------------
    def write(self, kv_cache, state, req_ids, c_kv, k_pe, query_start_loc, seq_lens, block_table, slot_mapping=None):
        """Write the step's tokens: packed copy into vLLM's pages, BF16 copies into the request state.

        ``c_kv [N, Dc]``, ``k_pe [N, Dr]`` (or ``[N, 1, Dr]``); ``req_ids`` in batch-row order (the state
        must be arranged to them); ``slot_mapping [N]`` (vLLM's ``block * block_size + offset``), if given, is
        checked against the block table."""
        k_pe = k_pe.reshape(k_pe.shape[0], -1)
        qsl = [int(v) for v in query_start_loc.tolist()]
        after = [int(v) for v in seq_lens.tolist()]
        n_new = [qsl[b + 1] - qsl[b] for b in range(len(after))]
        before = [a - n for a, n in zip(after, n_new)]
        if any(v < 0 for v in before):
            raise ValueError(f"seq_lens {after} shorter than the tokens scheduled {n_new}")
        if self.quantized and state is None:
            raise ValueError(f"format {self.layout.fmt.name} needs the per-request BF16 sink/local state")
        if self.quantized:
            for b, rid in enumerate(req_ids):
                if n_new[b] and before[b] == 0:
                    state.restart(rid, self.layer)
                elif n_new[b] and _never_written(state, self.layer, b):
                    raise RuntimeError(
                        f"request {rid!r} starts at position {before[b]} but its BF16 sink/local copies were never "
                        "written (a prefix-cache hit?); run vLLM with prefix caching off (--no-enable-prefix-caching)"
                    )
        view = self.view(kv_cache, state, block_table, before, after)
        if self.check_slots and slot_mapping is not None:
            _check_slot_mapping(view, before, n_new, slot_mapping[: qsl[-1]])
        T = max(n_new) if n_new else 0
        B = len(n_new)
        c_pad = c_kv.new_zeros(B, T, c_kv.shape[-1])
        r_pad = k_pe.new_zeros(B, T, k_pe.shape[-1])
        for b in range(B):
            c_pad[b, : n_new[b]] = c_kv[qsl[b] : qsl[b + 1]]
            r_pad[b, : n_new[b]] = k_pe[qsl[b] : qsl[b + 1]]
        view.write(c_pad, r_pad, n_new, impl=self.impl)

    def decode(self, kv_cache, state, q_lat, q_pe, seq_lens, block_table, softmax_scale: float):
        """One query per row: ``q_lat [B, H, Dc]``, ``q_pe [B, H, Dr]`` -> ``o_lat [B, H, Dc]`` fp32, ``lse [B, H]``."""
        lens = [int(v) for v in seq_lens.tolist()]
        view = self.view(kv_cache, state, block_table, lens, lens)
        return decode_attention(q_lat, q_pe, view, softmax_scale, impl=self.impl, return_lse=True)

    def gather(self, kv_cache, state, seq_lens, block_table) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantizing gather: every row's tokens as attention reads them at its current length (BF16 sink
        and local window, dequantized packed copies otherwise), concatenated: ``c_kv [sum n, Dc]``, ``k_pe [sum
        n, Dr]`` fp32."""
        lens = [int(v) for v in seq_lens.tolist()]
        view = self.view(kv_cache, state, block_table, lens, lens)
        Dc = self.layout.kv_lora_rank
        rows = [view.read_tokens(b, n) for b, n in enumerate(lens)]
        full = torch.cat(rows) if rows else torch.empty(0, Dc + self.layout.rope_dim, device=kv_cache.device)
        return full[:, :Dc], full[:, Dc:]

    def prefill(self, kv_cache, state, q_lat, q_pe, query_start_loc, seq_lens, block_table, softmax_scale: float):
        """Causal attention of the step's queries (``q_lat [N, H, Dc]``, ``q_pe [N, H, Dr]``, flat) over their
        rows' tokens read at the current length -> ``o_lat [N, H, Dc]`` fp32 (the semantics of
        :func:`quantmla.kernels.reference.prefill_attention_torch`)."""
        qsl = [int(v) for v in query_start_loc.tolist()]
        lens = [int(v) for v in seq_lens.tolist()]
        view = self.view(kv_cache, state, block_table, lens, lens)
        out = torch.empty(q_lat.shape[0], q_lat.shape[1], q_lat.shape[2], dtype=torch.float32, device=q_lat.device)
        for b in range(len(lens)):
            s, e = qsl[b], qsl[b + 1]
            if e == s:
                continue
            one = _row_view(view, b)
            o = prefill_attention_torch(q_lat[s:e].transpose(0, 1)[None], q_pe[s:e].transpose(0, 1)[None], one,
                                        softmax_scale, [e - s])
            out[s:e] = o[0].transpose(0, 1)
        return out

    def kernel(self, x: torch.Tensor, which: str) -> str:
        """Which implementation ``which`` ("write" or "decode") runs for tensors like ``x``."""
        return resolve_impl(self.impl, x, self.layout.fmt, kernel=which, layout=self.layout)


def _row_view(view: PagedView, b: int) -> PagedView:
    return PagedView(view.layout, view.pool, view.block_table[b : b + 1], [view._pages[b]], [view._lens[b]],
                     view.sink[b : b + 1], view.local[b : b + 1])


def _never_written(state: RequestStateTable, layer: int, b: int) -> bool:
    """The row's first sink slot still holds the NaN fill of a fresh row."""
    if state.sink.shape[2] == 0:
        return False
    return bool(state.sink[layer, b, 0].view(torch.int16).eq(-1).all())


def _check_slot_mapping(view: PagedView, before, n_new, slot_mapping: torch.Tensor) -> None:
    P = view.layout.page_size
    want = []
    for b, (s, k) in enumerate(zip(before, n_new)):
        pos = range(s, s + k)
        want += [view._pages[b][p // P] * P + p % P for p in pos]
    got = slot_mapping.to(torch.long).cpu().tolist()
    if got != want:
        raise RuntimeError(
            "vLLM's slot mapping disagrees with the block table and lengths the QuantMLA backend was given "
            f"(first tokens: got {got[:8]}, expected {want[:8]})"
        )
