"""The split-D packed decode kernel (``variant="splitd"``) against the fp32 torch reference, same hostile inputs and
tolerances as ``test_decode.py``; its PTX unpack checked bit for bit by a small emulator of the two instructions it
uses (the interpreter runs the integer-op twin of that asm)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from kernels_testutil import DEVICE, assert_close, make_cache

from quantmla.kernels import decode_attention
from quantmla.quant.formats import CachePolicy

O_TOL = dict(atol=3e-2, rtol=3e-2, min_cos=0.9995)
SCALE = 0.125


def _check(cache, H, splits=None, seed=0):
    from quantmla.kernels.triton_decode import TUNING_SPLITD, splitd_chunks

    nb = splitd_chunks(cache.fmt, cache.kv_lora_rank, cache.rope_dim, TUNING_SPLITD["nb"])
    assert nb > 0, f"{cache.fmt.name}: the split-D kernel would not run (falls back to base)"
    g = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(cache.batch, H, cache.kv_lora_rank, generator=g).to(DEVICE)
    q_pe = torch.randn(cache.batch, H, cache.rope_dim, generator=g).to(DEVICE)
    ref, ref_lse = decode_attention(q_lat, q_pe, cache, SCALE, impl="torch", return_lse=True)
    out, lse = decode_attention(q_lat, q_pe, cache, SCALE, impl="triton", return_lse=True, num_splits=splits,
                                variant="splitd")  # fmt: skip
    assert_close(out, ref, name=f"o_lat {cache.fmt.name}", **O_TOL)
    assert_close(lse, ref_lse, atol=3e-2, rtol=1e-2, min_cos=0.999, name=f"lse {cache.fmt.name}")
    return out, lse


@pytest.mark.parametrize("name,dc", [("c8r8", 128), ("c4r8", 128), ("c4r4", 128), ("c2r4", 256)])
def test_splitd_hostile_lengths(name, dc):
    """Lengths 0, 1, 17, 127, 128, 129; shuffled pages; NaN in every unwritten byte; 3 heads; 3 splits.
    (C2 at latent 256: at 128 its 32 code bytes per token are too few to cut into chunks.)"""
    cache, _, _ = make_cache(name, [0, 1, 17, 127, 128, 129], dc=dc, seed=1)
    out, lse = _check(cache, H=3, splits=3)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


@pytest.mark.parametrize("batch,heads", [(1, 5), (7, 1)])
def test_splitd_batches_and_heads(batch, heads):
    lens = [33, 70, 2, 16, 64, 5, 48][:batch]
    cache, _, _ = make_cache("c4r4", lens, seed=batch)
    _check(cache, H=heads)


def test_splitd_default_policy_window():
    """sink 4 / local 128 / page 64: lengths around the window edge."""
    cache, _, _ = make_cache("c4r4", [127, 128, 129, 200], policy=CachePolicy(), seed=3)
    _check(cache, H=2, splits=2)


@pytest.mark.parametrize("name", ["c8r8", "c2r4"])
def test_splitd_deepseek_shapes(name):
    """Latent 512 / RoPE 64 (C8: 4 chunks, C2: 2 chunks of 64 bytes), 16 heads, default split."""
    cache, _, _ = make_cache(name, [70, 133], dc=512, dr=64, seed=5)
    _check(cache, H=16)


def test_splitd_small_scales_long_split():
    """Small latent values (quantization scales ~1e-3) and peaked scores over one long split: the output weights
    ``p * s'`` go to fp16 unnormalized, so they must stay accurate far below 1."""
    cache, _, _ = make_cache("c4r4", [700], seed=7, value_scale=0.01)
    g = torch.Generator().manual_seed(7)
    q_lat = (torch.randn(1, 2, cache.kv_lora_rank, generator=g) * 60).to(DEVICE)
    q_pe = torch.randn(1, 2, cache.rope_dim, generator=g).to(DEVICE)
    ref = decode_attention(q_lat, q_pe, cache, SCALE, impl="torch")
    out = decode_attention(q_lat, q_pe, cache, SCALE, impl="triton", num_splits=1, variant="splitd")
    assert_close(out, ref, name="o_lat c4r4 small scales", **O_TOL)


def test_variant_selection(monkeypatch):
    from quantmla.kernels.triton_decode import VARIANT_ENV, resolve_variant

    monkeypatch.delenv(VARIANT_ENV, raising=False)
    assert resolve_variant(None) == "base"
    monkeypatch.setenv(VARIANT_ENV, "splitd")
    assert resolve_variant(None) == "splitd" and resolve_variant("base") == "base"
    monkeypatch.setenv(VARIANT_ENV, "fast")
    with pytest.raises(ValueError, match="variant"):
        resolve_variant(None)


# -- the PTX unpack, emulated ---------------------------------------------------------------------------------------


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` default mode: result byte i = byte (sel nibble i & 7) of {b, a}, sign-replicated if bit 3."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    regs = dict(inputs)
    for ins in re.findall(r"(prmt\.b32|and\.b32)\s+([^;]+);", text):
        op, args = ins[0], [x.strip() for x in ins[1].split(",")]

        def val(x):
            return regs[x] if x in regs else int(x, 0)

        if op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        else:
            regs[args[0]] = val(args[1]) & val(args[2])
    return regs


def _magic(code_byte: int, mask: int) -> int:
    return 0x6400 | (code_byte & mask)


@pytest.mark.parametrize("mask", [0x03, 0x0C, 0x30, 0xC0, 0x0F, 0xF0, 0xFF])
def test_ptx_unpack_bits(mask):
    from quantmla.kernels.triton_decode import _asm_words

    rng = random.Random(mask)
    for _ in range(200):
        b = [rng.randrange(256) for _ in range(4)]
        x = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # element i of a packed register in bits 16 i
        # 2 words (w0 = b0 | b1 << 8, w1 = b2 | b3 << 8) -> even: (b0, b2), odd: (b1, b3)
        assert _run_ptx(_asm_words(mask, False), {"$1": x})["$0"] == _magic(b[0], mask) | _magic(b[2], mask) << 16
        assert _run_ptx(_asm_words(mask, True), {"$1": x})["$0"] == _magic(b[1], mask) | _magic(b[3], mask) << 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["c8r8", "c4r8", "c4r4", "c2r4"])
def test_gpu_splitd_deepseek_shapes_long(name):
    """DeepSeek-V2-Lite shapes, default policy, lengths up to 4097, the compiled kernel (PTX unpack) on the GPU."""
    cache, _, _ = make_cache(name, [4097, 0, 1, 129, 1000], dc=512, dr=64, policy=CachePolicy(), writer="triton",
                             device="cuda")  # fmt: skip
    _check(cache, H=16)
    _check(cache, H=7, splits=5)
