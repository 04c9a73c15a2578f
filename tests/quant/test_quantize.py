"""Group quantization: error within half a step, NMSE matches the uniform-quantizer value, specs validate."""

import math

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


def test_zero_groups_are_exact():
    for spec in (QuantSpec(4, 64), QuantSpec(2, 64), QuantSpec(8, 64, True), QuantSpec(4, 64, True, "bf16")):
        x = torch.zeros(2, 128)
        xh = dequantize_codes(*quantize_codes(x, spec), spec)
        assert torch.equal(xh, x)


@pytest.mark.parametrize("spec", [QuantSpec(4, 64), QuantSpec(2, 32), QuantSpec(8, 64, False, "bf16")], ids=str)
@pytest.mark.parametrize("c", [0.25, -3.0, 1000.0, -0.0078125, 49152.0, 65504.0])
def test_nonzero_constant_groups_asymmetric_are_exact(spec, c):
    """A constant group whose value the scale dtype represents: the offset is that value, the code 0, exact."""
    if float(torch.tensor(c).to(spec.torch_scale_dtype).float()) != c:
        pytest.skip(f"{c} is not representable in {spec.scale_dtype}")
    x = torch.full((3, 128), c)
    x[1] = torch.randn(128)  # a varied token beside the constant ones changes nothing for them
    codes, scale, offset = quantize_codes(x, spec)
    xh = dequantize_codes(codes, scale, offset, spec)
    assert torch.equal(xh[0], x[0]) and torch.equal(xh[2], x[2])
    assert torch.equal(offset[0].float(), torch.full_like(offset[0].float(), c)) and int(codes[0].max()) == 0


@pytest.mark.parametrize("c", [0.1, -7.3, 1e-3])
def test_nonzero_constant_groups_within_half_a_step_of_a_tiny_step(c):
    """Not representable in fp16 / symmetric: within half a step, and the step is a tiny share of |c|
    (asymmetric: the fp16 rounding gap of c over 15 levels; symmetric: |c| / (2 qmax) at most)."""
    x = torch.full((1, 64), c)
    for spec, rel in ((QuantSpec(4, 64), 2**-10 / 15 + 1e-6), (QuantSpec(4, 64, True), 1 / 7),
                      (QuantSpec(8, 64, True), 1 / 127)):  # fmt: skip
        codes, scale, offset = quantize_codes(x, spec)
        err = (dequantize_codes(codes, scale, offset, spec) - x).abs().double()
        assert float(err.max()) <= 0.5 * float(scale.max()) * (1 + 1e-6)
        assert float(scale.max()) <= rel * abs(c) * 1.01


# ---- large finite values, inf and NaN (issue 13 item 4) --------------------------------------------------------

F16 = 65504.0
FORMAT_SPECS = {  # the paths of the named formats (content group 128, RoPE group 64; 8 bit is symmetric)
    "c4": QuantSpec(4, 128), "r4": QuantSpec(4, 64), "c2": QuantSpec(2, 128), "c8": QuantSpec(8, 128, True),
    "r8": QuantSpec(8, 64, True), "c4-bf16": QuantSpec(4, 128, False, "bf16"),
}  # fmt: skip


def _grid(scale, offset, spec):
    """[lo, hi] each group's stored grid covers (float64, from the stored scale/offset)."""
    s = scale.double()
    if spec.symmetric:
        qmax = (1 << (spec.bits - 1)) - 1
        return -qmax * s, qmax * s
    return offset.double(), offset.double() + ((1 << spec.bits) - 1) * s


@pytest.mark.parametrize("name", list(FORMAT_SPECS))
@pytest.mark.parametrize("big", [-7e4, 7e4, 1e6, -1e6, 1e7, -3e38, 3e38])
def test_large_finite_values_saturate_instead_of_poisoning_the_group(name, big):
    spec = FORMAT_SPECS[name]
    g = spec.group_size
    x = torch.randn(4, 2 * g, generator=torch.Generator().manual_seed(0))
    x[1, 3] = big
    x[2, :g] = big  # a constant group at the extreme
    x[3, 5], x[3, 6] = big, -big  # both extremes in one group
    codes, scale, offset = quantize_codes(x, spec)
    xh = dequantize_codes(codes, scale, offset, spec)
    assert torch.isfinite(scale).all() and (offset is None or torch.isfinite(offset).all())
    assert torch.isfinite(xh).all(), "a finite input must never read back as NaN/inf"
    # documented bound: half a step inside the stored grid, plus the distance to the grid outside it (float64)
    lo, hi = _grid(scale, offset, spec)
    lo, hi = lo.repeat_interleave(g, -1), hi.repeat_interleave(g, -1)
    xd = x.double()
    outside = (lo - xd).clamp_min(0) + (xd - hi).clamp_min(0)
    step = scale.double().repeat_interleave(g, -1)
    err = (xh.double() - xd).abs()
    assert bool((err <= 0.5 * step * (1 + 1e-6) + outside + 1e-6 * xd.abs()).all()), float((err - outside).max())
    # by hand: the stored range saturates at the scale dtype's largest finite value, not beyond
    fmax = torch.finfo(spec.torch_scale_dtype).max
    assert float(scale.double().max()) <= fmax
    if spec.scale_dtype == "fp16" and not spec.symmetric and big == -7e4:
        assert float(xh[1, 3]) == -F16  # -7e4 is stored as the offset floor -65504, exactly
    if spec.scale_dtype == "fp16" and spec.symmetric and abs(big) == 1e7:
        assert float(xh[1, 3]) == math.copysign(127 * F16, big)  # 8-bit symmetric: 127 steps of 65504
    # the untouched token and groups are quantized as if the extremes were not there (bit for bit)
    clean = torch.randn(4, 2 * g, generator=torch.Generator().manual_seed(0))
    c_codes, c_scale, _ = quantize_codes(clean, spec)
    assert torch.equal(codes[0], c_codes[0]) and torch.equal(scale[0], c_scale[0])
    assert torch.equal(codes[1, g:], c_codes[1, g:]) and torch.equal(scale[1, 1], c_scale[1, 1])


@pytest.mark.parametrize("name", ["c4", "c2", "c8", "c4-bf16"])
def test_nan_and_inf_poison_only_their_own_group(name):
    spec = FORMAT_SPECS[name]
    g = spec.group_size
    x = torch.randn(5, 3 * g, generator=torch.Generator().manual_seed(1))
    dirty = x.clone()
    dirty[1, 5] = float("nan")  # token 1, group 0
    dirty[2, g + 7] = float("inf")  # token 2, group 1
    dirty[3, 2 * g] = float("-inf")  # token 3, group 2
    codes, scale, offset = quantize_codes(dirty, spec)
    c_codes, c_scale, c_offset = quantize_codes(x, spec)
    hit = torch.zeros(5, 3, dtype=torch.bool)
    hit[1, 0] = hit[2, 1] = hit[3, 2] = True
    same = ~hit.repeat_interleave(g, -1)
    assert torch.equal(codes[same], c_codes[same]) and torch.equal(scale[~hit], c_scale[~hit])
    assert offset is None or torch.equal(offset[~hit], c_offset[~hit])
    xh = dequantize_codes(codes, scale, offset, spec)
    assert torch.equal(xh[same], dequantize_codes(c_codes, c_scale, c_offset, spec)[same])
    assert torch.isnan(xh[1, :g]).all()  # NaN poisons its group (and says so)
    assert torch.isfinite(xh[2]).all() and torch.isfinite(xh[3]).all()  # +-inf saturate like large values
    assert float(xh[2, g + 7]) == pytest.approx(float(_grid(scale, offset, spec)[1][2, 1]), rel=1e-6)  # top of grid
    assert int(codes.max()) < (1 << spec.bits)  # every code in range: packing cannot spill into a neighbour
    qp = quantize(dirty, spec)
    assert torch.equal(dequantize(qp)[same], xh[same])


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
