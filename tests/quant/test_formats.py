"""Cache formats: per-token byte layouts, whole-cache bytes, compression targets, name parsing."""

import math

import pytest

from quantmla.quant.formats import FORMATS, CacheFormat, CachePolicy, cache_bytes, get_format
from quantmla.quant.spec import QuantSpec

# Per-token bytes written out by hand from the layouts (latent 512, RoPE 64):
#   BF16 = (512 + 64) * 2; C8R8 = 512 + 4*2 + 64 + 1*2; C4R8 = 256 + 4*4 + 64 + 2;
#   C4R4 = 256 + 4*4 + 32 + 4; C2R4 = 128 + 4*4 + 32 + 4
HAND = {"bf16": 1152, "c8r8": 586, "c4r8": 338, "c4r4": 308, "c2r4": 180}
V2_LITE = dict(kv_lora_rank=512, rope_dim=64, num_layers=27)


@pytest.mark.parametrize("name", sorted(HAND))
def test_bytes_per_token_matches_hand_layout(name):
    assert FORMATS[name].bytes_per_token(512, 64) == HAND[name]


def test_whole_cache_bytes_by_hand_c4r4():
    pol = CachePolicy(sink=4, local=128, page_size=64)
    ctx, batch = 1000, 3
    b = cache_bytes("c4r4", context=ctx, batch=batch, policy=pol, **V2_LITE)
    slots = math.ceil(ctx / 64) * 64
    expect = 27 * batch * (slots * 308 + 132 * 1152) + batch * (math.ceil(ctx / 64) * 4 + 4)
    assert b.total == expect


def test_bf16_cache_has_no_buffers():
    b = cache_bytes("bf16", context=128, batch=1, **V2_LITE)
    assert b.bf16_buffers == 0 and b.scales == 0
    assert b.packed == 27 * 128 * 1152


def test_compression_targets_at_128k():
    bf16 = cache_bytes("bf16", context=131072, **V2_LITE).total
    assert bf16 / cache_bytes("c4r4", context=131072, **V2_LITE).total >= 3.7
    assert bf16 / cache_bytes("c2r4", context=131072, **V2_LITE).total >= 6.0


def test_short_context_buffers_are_capped():
    # A 10-token sequence keeps at most 10 full-precision copies, not sink + local.
    b = cache_bytes("c4r4", context=10, policy=CachePolicy(4, 128, 64), **V2_LITE)
    assert b.bf16_buffers == 27 * 10 * 1152


def test_get_format_parsing_and_errors():
    assert get_format("C4R4") is FORMATS["c4r4"]
    f = get_format("c8r4")
    assert f.content.bits == 8 and f.rope.bits == 4
    assert get_format("c4r16").rope is None
    with pytest.raises(ValueError, match="unknown cache format"):
        get_format("c3r4")
    with pytest.raises(ValueError, match="unknown cache format"):
        get_format("int4")


def test_format_dict_round_trip_and_dim_check():
    f = CacheFormat("custom", QuantSpec(4, 64), QuantSpec(8, 32, True))
    assert CacheFormat.from_dict(f.to_dict()) == f
    with pytest.raises(ValueError, match="content path .width 96."):
        FORMATS["c4r4"].check_dims(96, 64)
    with pytest.raises(TypeError, match="QuantSpec"):
        CacheFormat("x", content=4)


@pytest.mark.parametrize("kwargs", [dict(sink=-1), dict(local=-3), dict(page_size=0), dict(sink=1.5)])
def test_bad_policy_raises(kwargs):
    with pytest.raises(ValueError, match="CachePolicy"):
        CachePolicy(**kwargs)


def test_adapted_shrinks_oversized_groups_only():
    f = get_format("c4r4").adapted(256, 32)  # MiniCPM3-like widths
    assert f.content.group_size == 128 and f.rope.group_size == 32
    assert get_format("c4r4").adapted(512, 64) is get_format("c4r4")
    assert get_format("c4r4").adapted(96, 64).content.group_size == 128  # 96 is no divisor of 128: left alone


@pytest.mark.parametrize("sink,local", [(4, 16), (0, 16), (4, 0), (0, 0), (3, 1)])
def test_packed_for_all_is_what_every_query_of_a_block_reads_packed(sink, local):
    """For query blocks [q0, q0 + t): a position is in packed_for_all(q0) exactly when every query of the block sees
    it (causal) and reads_full sends each of them to its packed copy."""
    import torch

    policy = CachePolicy(sink=sink, local=local, page_size=16)
    for q0 in range(0, 40):
        for t in (1, 5):
            q = torch.arange(q0, q0 + t)
            k = torch.arange(0, q0 + t)
            every = ((k[None, :] <= q[:, None]) & ~policy.reads_full(q, k)).all(dim=0)  # [keys]
            assert list(policy.packed_for_all(q0)) == k[every].tolist(), (q0, t)
