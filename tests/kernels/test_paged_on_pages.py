"""PagedMLACache.on_pages: a cache over pages, block table and BF16 buffers a serving engine owns, checked against
the ordinary cache that allocated them (same bytes written, same tokens read, same attention)."""

from __future__ import annotations

import pytest
import torch

from quantmla.kernels.paged import PagedMLACache
from quantmla.kernels.reference import decode_attention_torch
from quantmla.quant.formats import CachePolicy

POLICY = CachePolicy(sink=4, local=16, page_size=16)
DC, DR = 128, 32


def _tokens(B, N, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, DC, generator=g) * torch.linspace(0.1, 2.0, DC), torch.randn(B, N, DR, generator=g)


def _owner(fmt, lens, extra):
    """An ordinary cache (shuffled pages, NaN fill) holding ``lens`` tokens, with pages reserved for ``extra``
    more tokens per sequence; and the tokens (``lens[b] + extra`` per sequence)."""
    B, N = len(lens), max(lens) + extra
    own = PagedMLACache(fmt, B, N, kv_lora_rank=DC, rope_dim=DR, policy=POLICY, shuffle=True, seed=1, fill_byte=0xFF)
    c, k = _tokens(B, N, 2)
    own.write_reference(c, k, lens)
    own.reserve([n + extra for n in lens])
    return own, c, k


def _on_pages(own):
    pages = [list(own.table.pages(b)) for b in range(own.batch)]
    return PagedMLACache.on_pages(own.layout, own.policy, own.pool, own.block_table, pages, own.lengths(), own.sink,
                                  own.local)


@pytest.mark.parametrize("fmt", ["bf16", "c4r4", "c2r4"])
def test_on_pages_reads_writes_and_attends_like_the_owner(fmt):
    lens = [0, 5, 37, 20]
    own, c, k = _owner(fmt, lens, extra=9)
    view = _on_pages(own)
    assert view.lengths() == lens and view.seq_lens.tolist() == lens
    assert view.pool.data_ptr() == own.pool.data_ptr()  # nothing copied
    for b in range(len(lens)):
        assert torch.equal(view.read_tokens(b), own.read_tokens(b))
    g = torch.Generator().manual_seed(3)
    q_lat, q_pe = torch.randn(4, 3, DC, generator=g), torch.randn(4, 3, DR, generator=g)
    o1, l1 = decode_attention_torch(q_lat, q_pe, view, 0.1, return_lse=True)
    o2, l2 = decode_attention_torch(q_lat, q_pe, own, 0.1, return_lse=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    # a write through the view lands exactly where the owner's own write would: compare with a twin owner
    twin, _, _ = _owner(fmt, lens, extra=9)
    pool0, sink0, local0 = own.pool.clone(), own.sink.clone(), own.local.clone()
    new = [3, 9, 1, 0]
    idx = torch.tensor(lens)[:, None] + torch.arange(9)[None, :]  # the next 9 positions of each sequence
    cn, kn = c.gather(1, idx[..., None].expand(-1, -1, DC)), k.gather(1, idx[..., None].expand(-1, -1, DR))
    view.write_reference(cn, kn, new)
    twin.write_reference(cn, kn, new)
    assert view.lengths() == [a + b for a, b in zip(lens, new)]
    assert torch.equal(own.pool, twin.pool) and not torch.equal(own.pool, pool0)
    assert torch.equal(own.sink.view(torch.int16), twin.sink.view(torch.int16)) or sink0.shape[1] == 0
    assert torch.equal(own.local.view(torch.int16), twin.local.view(torch.int16)) or local0.shape[1] == 0


def test_on_pages_never_allocates():
    own, c, k = _owner("c4r4", [16, 40], extra=0)
    view = _on_pages(own)
    with pytest.raises(RuntimeError, match="out of cache pages"):
        view.write_reference(c[:, :1], k[:, :1], [1, 0])  # position 16 needs a page the engine did not hand out
    pages = [list(own.table.pages(b)) for b in range(2)]
    with pytest.raises(ValueError, match="covered by its pages"):
        PagedMLACache.on_pages(own.layout, own.policy, own.pool, own.block_table, pages, [17, 40], own.sink, own.local)
    with pytest.raises(ValueError, match="int32"):
        PagedMLACache.on_pages(own.layout, own.policy, own.pool, own.block_table.long(), pages, [16, 40], own.sink,
                               own.local)
