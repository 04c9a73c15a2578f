"""The vLLM-free core of the serving backend: write, decode and gather on tensors shaped as vLLM passes them.

vLLM owns the pages (one tensor per layer, ``[num_blocks, ...]`` holding ``page_bytes`` per block), the block
table ``[B, max_blocks]`` int32, the token -> slot mapping and the per-step lengths; we own the per-request
BF16 sink/local copies (:class:`~quantmla.serve.request_state.RequestStateTable`). :class:`ServeLayer` binds
these to a :meth:`~quantmla.kernels.paged.PagedMLACache.on_pages` cache (no copy) and calls the kernels' own
entry points: ``write`` (the torch reference ``write_reference``, or the fused Triton writer, bit-identical),
``decode_attention``, ``prefill_attention`` (every query reads each token through the cache policy, as
token-by-token decoding would) and ``read_tokens`` (the dequantizing gather). The byte order inside a page is
never decoded here. A layer built with a RoPE rounding plan (the checkpoint's ``quantmla_rope_rounding.st``,
:mod:`quantmla.calibrate.query_moments`) writes its RoPE keys with query-aware rounding, as ``quantmla generate``
and ``quantmla eval`` do.

Flat (vLLM) shapes: ``c_kv [N, Dc]``, ``k_pe [N, Dr]`` for the ``N`` tokens of a step, rows ``b`` owning
``query_start_loc[b] : query_start_loc[b + 1]``; ``seq_lens [B]`` = lengths *after* the step's tokens.
"""

from __future__ import annotations

import math

import torch

from quantmla.kernels.dispatch import decode_attention, prefill_attention, resolve_impl
from quantmla.kernels.paged import PagedLayout, PagedMLACache
from quantmla.quant.formats import CachePolicy
from quantmla.quant.rounding import RopeRounding
from quantmla.serve.request_state import RequestStateTable


class ServeLayer:
    """One attention layer's view of the serving cache (format, geometry, which kernels)."""

    def __init__(self, layout: PagedLayout, layer: int, *, impl: str = "auto", check_slots: bool = True,
                 rope_rounding: RopeRounding | None = None) -> None:  # fmt: skip
        self.layout, self.layer, self.impl, self.check_slots = layout, layer, impl, check_slots
        # query-aware rounding of the RoPE key (quantmla.quant.rounding): every write of this layer uses it
        self.rope_rounding = rope_rounding
        if rope_rounding is not None and layout.fmt.rope is None:
            raise ValueError(f"format {layout.fmt.name} stores the RoPE key in BF16: a rounding plan has nothing to "
                             "round")  # fmt: skip

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
        flat = raw.view(raw.shape[0], -1)  # a view (never a copy): writes must land in vLLM's tensor
        return flat[:, : self.layout.page_bytes]

    def view(self, kv_cache, state: RequestStateTable | None, block_table, lens_before, lens_after,
             first_row: int = 0) -> PagedMLACache:  # fmt: skip
        """A :meth:`PagedMLACache.on_pages` cache over vLLM's pages and our state: row ``b`` holds
        ``lens_before[b]`` tokens and owns the blocks for ``lens_after[b]``; the rows are batch rows ``first_row ..``
        of the arranged state (e.g. vLLM's prefill rows, which follow its decode rows)."""
        P = self.layout.page_size
        bt_host = block_table.cpu()
        pages = [bt_host[b, : math.ceil(n / P)].tolist() for b, n in enumerate(lens_after)]
        B = block_table.shape[0]
        if self.quantized:
            if state is None:
                raise ValueError(f"format {self.layout.fmt.name} needs the per-request BF16 sink/local state")
            sink, local = state.batch_views(self.layer, B, start=first_row)
        else:
            d = self.layout.kv_lora_rank + self.layout.rope_dim
            sink = local = torch.empty(B, 0, d, dtype=torch.bfloat16, device=kv_cache.device)
        policy = CachePolicy(sink=sink.shape[1], local=local.shape[1], page_size=P)
        bt = block_table.to(device=kv_cache.device, dtype=torch.int32)
        view = PagedMLACache.on_pages(self.layout, policy, self.pool(kv_cache), bt, pages, list(lens_before), sink,
                                      local)  # fmt: skip
        if self.rope_rounding is not None:
            view.set_rope_rounding(self.rope_rounding)
        return view

    # -- the operations -------------------------------------------------------------------------------
    def write(self, kv_cache, state, req_ids, c_kv, k_pe, query_start_loc, seq_lens, block_table, slot_mapping=None):
        """Write the step's tokens: packed copy into vLLM's pages, BF16 copies into the request state.

        ``c_kv [N, Dc]``, ``k_pe [N, Dr]`` (or ``[N, 1, Dr]``; rows past ``query_start_loc[-1]`` are padding and
        ignored); ``req_ids`` in batch-row order (the state must be arranged to them); ``slot_mapping [N]``
        (vLLM's ``block * block_size + offset``), if given, is checked against the block table.

        Returns ``recent`` bf16 ``[B, W, Dc + Dr]`` (or None): per row the BF16 copies of its last ``W`` positions
        after the write, which the step's prefill queries may read in full precision but which the write pushed
        out of the local ring; pass it to :meth:`prefill`."""
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
        c_pad, r_pad = _padded(c_kv, qsl), _padded(k_pe, qsl)  # [B, T, Dc], [B, T, Dr]
        recent = None
        if self.quantized and view.n_local and max(n_new, default=0) > 1:
            recent = view.recent_window(c_pad, r_pad, before, n_new)
        view.write(c_pad, r_pad, n_new, impl=self.impl)
        return recent

    def decode(self, kv_cache, state, q_lat, q_pe, seq_lens, block_table, softmax_scale: float, first_row: int = 0):
        """One query per row: ``q_lat [B, H, Dc]``, ``q_pe [B, H, Dr]`` -> ``o_lat [B, H, Dc]`` fp32, ``lse [B, H]``."""
        lens = [int(v) for v in seq_lens.tolist()]
        view = self.view(kv_cache, state, block_table, lens, lens, first_row)
        return decode_attention(q_lat, q_pe, view, softmax_scale, impl=self.impl, return_lse=True)

    def gather(self, kv_cache, state, seq_lens, block_table, first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantizing gather: every row's tokens as its newest token reads them (BF16 sink and local window,
        dequantized packed copies otherwise), concatenated: ``c_kv [sum n, Dc]``, ``k_pe [sum n, Dr]`` fp32, the RoPE
        key in the model's coordinates (a rounding plan's post-RoPE rotation undone, as the model's queries need)."""
        lens = [int(v) for v in seq_lens.tolist()]
        view = self.view(kv_cache, state, block_table, lens, lens, first_row)
        Dc = self.layout.kv_lora_rank
        rows = [view.read_tokens(b, n) for b, n in enumerate(lens)]
        full = torch.cat(rows) if rows else torch.empty(0, Dc + self.layout.rope_dim, device=kv_cache.device)
        return full[:, :Dc], view.rope_key_out(full[:, Dc:])

    def prefill(self, kv_cache, state, q_lat, q_pe, query_start_loc, seq_lens, block_table, softmax_scale: float,
                recent: torch.Tensor | None = None, first_row: int = 0):  # fmt: skip
        """Causal attention of the step's queries (``q_lat [N, H, Dc]``, ``q_pe [N, H, Dr]``, flat; their tokens
        already written) over their rows' tokens, each query reading every token through the cache policy (the
        semantics of :func:`quantmla.kernels.reference.prefill_attention_torch`, so a prompt gives what
        token-by-token decoding would) -> ``o_lat [N, H, Dc]`` fp32. ``recent``: what :meth:`write` returned (its
        rows ``first_row ..``)."""
        qsl = [int(v) for v in query_start_loc.tolist()]
        lens = [int(v) for v in seq_lens.tolist()]
        n_new = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
        view = self.view(kv_cache, state, block_table, lens, lens, first_row)
        ql = _padded(q_lat, qsl).transpose(1, 2)  # [B, H, T, Dc]
        qp = _padded(q_pe, qsl).transpose(1, 2)  # [B, H, T, Dr]
        impl = "torch" if self.impl == "torch" else "auto"
        o = prefill_attention(ql, qp, view, softmax_scale, n_new, recent=recent, impl=impl)  # [B, H, T, Dc]
        out = torch.empty(qsl[-1], q_lat.shape[1], q_lat.shape[2], dtype=torch.float32, device=q_lat.device)
        for b, k in enumerate(n_new):
            out[qsl[b] : qsl[b + 1]] = o[b, :, :k].transpose(0, 1)
        return out

    def kernel(self, x: torch.Tensor, which: str) -> str:
        """Which implementation ``which`` ("write" or "decode") runs for tensors like ``x``."""
        return resolve_impl(self.impl, x, self.layout.fmt, kernel=which, layout=self.layout)


def _padded(x: torch.Tensor, qsl: list[int]) -> torch.Tensor:
    """Flat rows ``x [N, ...]`` (row ``b`` = ``x[qsl[b]:qsl[b+1]]``) -> zero-padded ``[B, T, ...]``."""
    n = [qsl[b + 1] - qsl[b] for b in range(len(qsl) - 1)]
    out = x.new_zeros(len(n), max(n, default=0), *x.shape[1:])
    for b, k in enumerate(n):
        out[b, :k] = x[qsl[b] : qsl[b + 1]]
    return out


def _never_written(state: RequestStateTable, layer: int, b: int) -> bool:
    """The row's first sink slot still holds the NaN fill of a fresh row."""
    if state.sink.shape[2] == 0:
        return False
    return bool(state.sink[layer, b, 0].view(torch.int16).eq(-1).all())


def _check_slot_mapping(view: PagedMLACache, before, n_new, slot_mapping: torch.Tensor) -> None:
    P = view.layout.page_size
    want = []
    for b, (s, k) in enumerate(zip(before, n_new)):
        pages = view.table.pages(b)
        want += [pages[p // P] * P + p % P for p in range(s, s + k)]
    got = slot_mapping.to(torch.long).cpu().tolist()
    if got != want:
        raise RuntimeError(
            "vLLM's slot mapping disagrees with the block table and lengths the QuantMLA backend was given "
            f"(first tokens: got {got[:8]}, expected {want[:8]})"
        )
