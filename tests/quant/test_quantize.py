"""Group quantization: error within half a step, NMSE matches the uniform-quantizer value, specs validate."""

import pytest
import torch

from quantmla.quant.quantize import dequantize, dequantize_codes, fake_quantize, quantize, quantize_codes
from quantmla.quant.spec import QuantSpec

SPECS = [
    QuantSpec(bits, g, sym, sd)
    for bits in (2, 4, 8)
    for g in (32, 64, 128)
    for sym in (False, True)
    for sd in ("fp16", "bf16")
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_error_at_most_half_a_step(spec):
    torch.manual_seed(spec.bits + spec.group_size)
    x = torch.randn(7, 33, 256) * torch.rand(7, 33, 1) * 5 + torch.randn(7, 33, 1)  # varied scales and offsets
    codes, scale, offset = quantize_codes(x, spec)
    xh = dequantize_codes(codes, scale, offset, spec)
    step = scale.float().repeat_interleave(spec.group_size, dim=-1)
    err = (xh - x.float()).abs()
    # half a step, plus fp32 rounding of the affine reconstruction
    assert bool((err <= 0.5 * step * (1 + 1e-5) + 1e-6 * x.abs().amax()).all()), float((err / step).max())
    # codes use the documented range
    assert int(codes.max()) < (1 << spec.bits)
    if spec.symmetric:
        assert int(codes.min()) >= 1  # -(2^(b-1) - 1) + 2^(b-1)


@pytest.mark.parametrize(
    "bits,sym", [(8, False), (8, True), (4, False), (4, True), (2, False)]
)
@pytest.mark.parametrize("g", [32, 128])
def test_nmse_matches_uniform_quantizer(bits, sym, g):
    # A uniform quantizer with step D has MSE D^2/12 when the error is uniform; compare measured NMSE on
    # Gaussian data with the prediction from the per-group steps (within 10%). Symmetric 2-bit has only
    # 3 levels (a dead-zone quantizer), where the uniform-error model does not hold; it is excluded.
    torch.manual_seed(bits * 7 + g)
    x = torch.randn(4096, 512, dtype=torch.float64).float()
    spec = QuantSpec(bits, g, sym)
    codes, scale, offset = quantize_codes(x, spec)
    xh = dequantize_codes(codes, scale, offset, spec).double()
    nmse = ((xh - x.double()) ** 2).mean() / (x.double() ** 2).mean()
    predicted = (scale.double() ** 2 / 12).mean() / (x.double() ** 2).mean()
    assert abs(float(nmse / predicted) - 1) < 0.10


def test_quantize_dequantize_pack_round_trip_and_qdq():
    spec = QuantSpec(4, 64)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    qp = quantize(x, spec)
    assert qp.codes.shape == (3, 5, 64) and qp.scale.shape == (3, 5, 2) and qp.scale.dtype == torch.float16
    codes, scale, offset = quantize_codes(x, spec)
    torch.testing.assert_close(dequantize(qp), dequantize_codes(codes, scale, offset, spec), rtol=0, atol=0)
    assert fake_quantize(x, spec).dtype == torch.bfloat16
    assert fake_quantize(x, None) is x


def test_constant_and_zero_groups_are_exact():
    for spec in (QuantSpec(4, 64), QuantSpec(2, 64), QuantSpec(4, 64, True)):
        x = torch.zeros(2, 128)
        x[1] = 0.0
        xh = dequantize_codes(*quantize_codes(x, spec), spec)
        assert torch.equal(xh, x)
        assert torch.isfinite(xh).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=3), "bits=3"),
        (dict(bits=16), "bits=16"),
        (dict(group_size=0), "group_size"),
        (dict(scale_dtype="fp32"), "scale_dtype"),
    ],
)
def test_bad_specs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantSpec(**kwargs)


def test_group_size_must_divide_width():
    with pytest.raises(ValueError, match="does not divide the path width 96"):
        quantize_codes(torch.randn(2, 96), QuantSpec(4, 64))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_codes(torch.zeros(2, 64, dtype=torch.int32), QuantSpec(4, 64))


def test_spec_dict_round_trip():
    s = QuantSpec(2, 128, False, "bf16")
    assert QuantSpec.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="unknown"):
        QuantSpec.from_dict({"bits": 4, "colour": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "spec", [QuantSpec(4, 128), QuantSpec(2, 128), QuantSpec(4, 64), QuantSpec(8, 128, True)], ids=str
)
def test_cuda_quantizer_bit_identical_to_cpu(spec):
    # The packed cache must not depend on where it was written.
    x = torch.randn(64, 300, 512) * torch.rand(64, 300, 1) * 3
    c_cpu, s_cpu, o_cpu = quantize_codes(x, spec)
    c_gpu, s_gpu, o_gpu = quantize_codes(x.cuda(), spec)
    assert torch.equal(c_cpu, c_gpu.cpu()) and torch.equal(s_cpu, s_gpu.cpu())
    assert (o_cpu is None and o_gpu is None) or torch.equal(o_cpu, o_gpu.cpu())
