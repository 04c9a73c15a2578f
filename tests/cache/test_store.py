"""The paged store behind QuantMLACache: every byte accounted for, capacity, per-layer formats, row selection."""

import pytest
import torch

from quantmla.cache.hf import QuantMLACache
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.quant.formats import CachePolicy, cache_bytes, get_format
from quantmla.quant.quantize import fake_quantize


def spec(layers=1, dc=128, dr=64):
    return MLASpec(model_type="deepseek_v3", num_layers=layers, hidden_size=64, num_heads=2, kv_lora_rank=dc,
                   qk_rope_head_dim=dr, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, rope_pairing="half",
                   softmax_scale=0.1, latent_norm=True)  # fmt: skip


def _fill(cache, chunks, batch=2, seed=0):
    """Write the same random chunks into every layer (absorbed protocol); returns the raw c_kv, k_pe."""
    g = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    c = torch.randn(batch, n, cache.spec.kv_lora_rank, generator=g)
    r = torch.randn(batch, n, cache.spec.qk_rope_head_dim, generator=g)
    i = 0
    for t in chunks:
        for lay in range(len(cache.layers)):
            cache.mla_layer(lay).write(c[:, i : i + t], r[:, i : i + t])
        i += t
    for lay in range(len(cache.layers)):
        cache.mla_layer(lay).flush()
    return c, r


def _held_tensors(obj) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts (independent of the cache's
    own accounting), one per storage."""
    seen, found, todo = set(), {}, [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found[o.untyped_storage().data_ptr()] = o
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            todo.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            todo.extend(vars(o).values())
    return list(found.values())


@pytest.mark.parametrize("fmts", [["c4r4"], ["c4r4", "bf16", "c2r4"]])
def test_memory_report_is_every_byte_held(fmts):
    cache = QuantMLACache(spec(len(fmts)), fmts, CachePolicy(4, 16, 16))
    _fill(cache, [37, 1, 1, 60, 1])  # grows the pool, the block table and the ring along the way
    held = sum(t.untyped_storage().nbytes() for t in _held_tensors(cache))
    rep = cache.memory_report()
    assert rep["allocated_bytes"] == held == cache.memory_bytes()
    by = rep["bytes_by_component"]
    assert by["pool_used"] + by["pool_spare"] == by["pool"] and by["pool_spare"] >= 0
    assert rep["tokens"] == 100 and rep["batch"] == 2


def test_c4r4_holds_less_than_bf16_at_16k_tokens():
    """Issue 10: the dual-path cache held an fp32 copy of every token (43 MB for a C4R4 layer at 16K tokens
    against 38 MB for BF16). Now a C4R4 layer holds its pages and BF16 buffers only."""
    sizes = {}
    for f in ("c4r4", "bf16"):
        cache = QuantMLACache(spec(1, 512, 64), f, max_length=16384)
        _fill(cache, [4096] * 4, batch=1)
        sizes[f] = cache.memory_report()["allocated_bytes"]
    per_token = get_format("c4r4").bytes_per_token(512, 64)  # 308
    assert sizes["c4r4"] <= 16384 * per_token + (4 + 128) * 1152 + 4096  # pages + BF16 buffers + table, lengths
    assert sizes["bf16"] >= 16384 * 1152
    assert sizes["c4r4"] < 0.28 * sizes["bf16"]


def test_fixed_capacity_is_enforced():
    cache = QuantMLACache(spec(), "c4r4", CachePolicy(4, 8, 16), max_length=20)
    lay = cache.mla_layer(0)
    lay.write(torch.randn(1, 20, 128), torch.randn(1, 20, 64))
    lay.flush()
    with pytest.raises(ValueError, match="max_length=20"):
        lay.write(torch.randn(1, 1, 128), torch.randn(1, 1, 64))
        lay.flush()
    assert lay.get_seq_length() == 20 and cache.get_max_length() == 20
    with pytest.raises(ValueError, match="max_length"):
        QuantMLACache(spec(), "c4r4", max_length=0)


def test_policy_larger_than_the_capacity():
    """Issue 13 item 9: CachePolicy(sink=10**9) once tried a 640 GB allocation at the first write."""
    model = tiny_model("deepseek_v3")
    with pytest.raises(ValueError, match=r"sink=1000000000.*max_position_embeddings = 512"):
        QuantMLACache(model.config, "c4r4", CachePolicy(sink=10**9))
    fits = QuantMLACache(model.config, "c4r4", CachePolicy(local=300), max_length=20)  # window > capacity: fine
    _fill(fits, [20], batch=1)
    assert fits.mla_layer(0).view.n_local == 20  # a ring as long as the longest sequence the cache holds
    cache = QuantMLACache(spec(), "c4r4", CachePolicy(sink=10**9, local=10**9, page_size=16))  # no capacity known
    c, r = _fill(cache, [10, 1], batch=1)
    assert cache.memory_bytes() < 100_000  # buffers sized by what the cache can hold, not by the policy
    got = cache.mla_layer(0).read()[0]
    assert torch.equal(got, c.bfloat16().float())  # sink covers every token: all read from BF16


def test_per_layer_formats():
    fmts = ["c4r4", "bf16", "c2r4"]
    cache = QuantMLACache(spec(3), fmts, CachePolicy(0, 0, 16))
    c, r = _fill(cache, [20], batch=1)
    for i, f in enumerate(fmts):
        f = get_format(f).adapted(128, 64)
        got = cache.mla_layer(i).view.read_packed(0, torch.arange(20))
        want_c = fake_quantize(c[0], f.content) if f.content else c[0].bfloat16().float()
        want_r = fake_quantize(r[0], f.rope) if f.rope else r[0].bfloat16().float()
        torch.testing.assert_close(got, torch.cat([want_c, want_r], -1), rtol=0, atol=0)
    rep = cache.memory_report()
    assert rep["format"] == "mixed" and rep["formats"] == fmts
    kw = dict(kv_lora_rank=128, rope_dim=64, num_layers=1, context=20, batch=1, policy=cache.policy)
    table = cache_bytes("bf16", **kw).metadata  # block table + lengths: once for the cache, not once per layer
    assert rep["physical_bytes_bf16_model"] == sum(cache_bytes(f, **kw).total for f in fmts) - 2 * table

    class Plan:  # what a per-layer bit allocation hands over
        formats = ("c8r8", "c4r4", "c4r4")

    assert [f.name for f in QuantMLACache(spec(3), Plan()).formats] == list(Plan.formats)
    with pytest.raises(ValueError, match="2 per-layer formats for a model with 3"):
        QuantMLACache(spec(3), ["c4r4", "c4r4"])
    with pytest.raises(ValueError, match="unknown cache format"):
        QuantMLACache(spec(3), ["c4r4", "c3r3", "c4r4"])


def test_selected_rows_are_independent_copies():
    """Beam search repeats rows: each copy must own its pages (a write to one never shows in the other)."""
    cache = QuantMLACache(spec(2), "c4r4", CachePolicy(2, 4, 16))
    _fill(cache, [21], batch=3)
    before = [cache.mla_layer(i).read() for i in range(2)]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    extra_c, extra_r = torch.randn(3, 1, 128), torch.randn(3, 1, 64)
    for i in range(2):
        got_c, got_r = cache.mla_layer(i).read()
        assert torch.equal(got_c, before[i][0][[2, 0, 0]]) and torch.equal(got_r, before[i][1][[2, 0, 0]])
        cache.mla_layer(i).write(extra_c, extra_r)
        cache.mla_layer(i).flush()
        got_c = cache.mla_layer(i).read()[0]
        assert torch.equal(got_c[1, :21], got_c[2, :21])  # same history
        assert torch.equal(got_c[:, 21], extra_c[:, 0].bfloat16().float())  # own newest token (local window)
    cache.batch_select_indices(torch.tensor([True, False, True]))
    assert cache.store.batch == 2 and cache.get_seq_length() == 22
