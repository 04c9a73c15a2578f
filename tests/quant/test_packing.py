"""Bit packing round-trips bit for bit and follows the documented planar layout."""

import pytest
import torch

from quantmla.quant.packing import pack, unpack


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 17, 97])
@pytest.mark.parametrize("width", [64, 512])
def test_round_trip_bit_exact(bits, tokens, width):
    g = torch.Generator().manual_seed(bits * 1000 + tokens)
    codes = torch.randint(0, 1 << bits, (2, tokens, width), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, tokens, width * bits // 8)
    assert torch.equal(unpack(packed, bits, width), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_planar_layout_matches_docstring(bits):
    # Independent construction of the layout: byte j holds channel j + p * D/k in bits [p*b, (p+1)*b).
    width, per = 32, 8 // bits
    codes = torch.randint(0, 1 << bits, (width,), dtype=torch.uint8)
    packed = pack(codes, bits).tolist()
    for j in range(width // per):
        expect = 0
        for p in range(per):
            expect |= int(codes[j + p * width // per]) << (p * bits)
        assert packed[j] == expect


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="supported widths"):
        pack(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack(torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(TypeError, match="uint8"):
        pack(torch.zeros(8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="bytes"):
        unpack(torch.zeros(5, dtype=torch.uint8), 4, 16)
