"""Group-wise integer quantize / dequantize of a cache path (the torch reference every kernel matches).

Asymmetric (default): per group ``m = min``, ``s = (max - min) / (2^b - 1)``; both are stored in the
spec's scale dtype, rounded so that the stored grid still covers ``[min, max]`` (``m`` rounded down, ``s``
rounded up); ``q = clamp(round((x - m) / s), 0, 2^b - 1)``; ``x_hat = q * s + m``.

Symmetric: ``s = absmax / (2^(b-1) - 1)`` (rounded up), ``q = clamp(round(x / s), -(2^(b-1)-1), 2^(b-1)-1)``
stored with offset ``2^(b-1)``; ``x_hat = (q - 2^(b-1)) * s``.

Either way the reconstruction error of every element is at most half a quantization step (up to
fp32 rounding). All arithmetic is fp32, whatever the input dtype.

**Saturation** (large finite inputs; a serving cache must not raise mid-generation). ``m`` and ``s`` are clamped
to the finite range ``[-F, F]`` of the scale dtype (``F`` = 65504 for fp16; for bf16 ``F_max(fp32) / 4`` and
``/ (4 qmax)`` so that the reconstruction stays finite in fp32) before they are rounded, so they never overflow
to inf (which used to turn the whole group into NaN). The stored grid then covers
``[m, m + (2^b - 1) s]`` (asymmetric) or ``[-(2^(b-1)-1) s, (2^(b-1)-1) s]`` (symmetric) and every code is
clamped to it, so the error bound becomes ``|x - x_hat| <= s / 2 + dist(x, grid)``: unchanged for groups whose
values fit (asymmetric fp16: ``min >= -F`` and ``max <= m + (2^b - 1) F``, e.g. ``max - min <= 982,560`` at 4 bits;
symmetric fp16: ``absmax <= (2^(b-1) - 1) F``, 8.3e6 at 8 bits), and values beyond the grid are clipped to
its nearest end (-7e4 is stored as -65504). +-inf inputs clip the same way. A NaN input makes its own group's
scale/offset NaN (that group reads back as NaN; its codes are those of 0 relative to the offset / zero point);
it never reaches another group or token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.quant.packing import pack, unpack
from quantmla.quant.spec import QuantSpec

_TINY = 1e-8


@dataclass
class QuantizedPath:
    """One cache path quantized with a :class:`QuantSpec`.

    codes: uint8 ``[..., D * bits / 8]`` packed codes (planar layout).
    scale: ``[..., D / group]`` in the spec's scale dtype.
    offset: ``[..., D / group]`` (asymmetric) or None (symmetric).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    spec: QuantSpec
    width: int


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 ``x >= 0`` to ``dtype`` so that the stored value is >= x (when representable). Always through
    ``where`` (no ``if low.any()``: on a GPU that test is a host wait, every quantization of every calibration step)."""
    r = x.to(dtype)
    return torch.where(r.float() < x, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r = x.to(dtype)
    return torch.where(r.float() > x, torch.nextafter(r, torch.full_like(r, float("-inf"))), r)


def _div(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x / d`` as an IEEE division on every device (CUDA turns division by a Python scalar into a
    multiplication by its reciprocal, which rounds differently; the kernels match true division)."""
    return x / torch.full_like(x, float(d))


def _saturation(sd: torch.dtype, qmax: int) -> tuple[float, float]:
    """(offset bound, scale bound) of a scale dtype: its largest finite value (65504 for fp16), and for the
    fp32-range bf16 small enough that ``|m| + qmax * s`` (the reconstruction) stays finite in fp32."""
    f, big = torch.finfo(sd).max, torch.finfo(torch.float32).max / 4
    return min(f, big), min(f, big / qmax)


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """One NaN bit pattern (0x7E00 in fp16) for every NaN, whatever the arithmetic produced: the stored bytes
    must not depend on the device."""
    return t.masked_fill(torch.isnan(t), float("nan"))


def _check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    if not torch.is_floating_point(x):
        raise TypeError(f"can only quantize floating-point tensors, got {x.dtype}")
    spec.check_width(x.shape[-1])


def quantize_codes(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x [..., D]`` -> (unpacked uint8 codes ``[..., D]``, scale, offset)."""
    _check_input(x, spec)
    d = x.shape[-1]
    g = spec.group_size
    sd = spec.torch_scale_dtype
    xg = x.float().reshape(*x.shape[:-1], d // g, g)  # [..., G, g]
    if spec.symmetric:
        qmax = (1 << (spec.bits - 1)) - 1
        _, smax = _saturation(sd, qmax)
        absmax = xg.abs().amax(dim=-1)
        scale = _round_up(_div(absmax, qmax).clamp(_TINY, smax), sd)  # [..., G]
        q = torch.round(xg / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax).nan_to_num_(nan=0.0)  # NaN -> 0
        codes = (q + (1 << (spec.bits - 1))).to(torch.uint8)
        offset = None
    else:
        qmax = (1 << spec.bits) - 1
        omax, smax = _saturation(sd, qmax)
        lo = xg.amin(dim=-1)
        hi = xg.amax(dim=-1)
        offset = _round_down(lo.clamp(-omax, omax), sd)
        scale = _round_up(_div(hi - offset.float(), qmax).clamp(_TINY, smax), sd)
        q = torch.round((xg - offset.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, qmax)
        codes = q.nan_to_num_(nan=0.0).to(torch.uint8)  # NaN -> code 0
        offset = _canonical_nan(offset)
    scale = _canonical_nan(scale)
    return codes.reshape(x.shape), scale, offset


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, spec: QuantSpec
) -> torch.Tensor:
    """Unpacked codes ``[..., D]`` -> fp32 ``[..., D]``."""
    d = codes.shape[-1]
    g = spec.group_size
    q = codes.float().reshape(*codes.shape[:-1], d // g, g)
    if spec.symmetric:
        x = (q - (1 << (spec.bits - 1))) * scale.float().unsqueeze(-1)
    else:
        if offset is None:
            raise ValueError("asymmetric spec needs an offset tensor")
        x = q * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    return x.reshape(codes.shape)


def quantize(x: torch.Tensor, spec: QuantSpec) -> QuantizedPath:
    """Quantize and pack ``x [..., D]``."""
    codes, scale, offset = quantize_codes(x, spec)
    return QuantizedPath(pack(codes, spec.bits), scale, offset, spec, x.shape[-1])


def dequantize(qp: QuantizedPath) -> torch.Tensor:
    """Unpack and dequantize to fp32 ``[..., D]``."""
    codes = unpack(qp.codes, qp.spec.bits, qp.width)
    return dequantize_codes(codes, qp.scale, qp.offset, qp.spec)


def fake_quantize(x: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """Quantize-dequantize (QDQ) ``x`` and return it in ``x``'s dtype; identity when ``spec`` is None."""
    if spec is None:
        return x
    codes, scale, offset = quantize_codes(x, spec)
    return dequantize_codes(codes, scale, offset, spec).to(x.dtype)


def step_size(scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The quantization step of each group (equal to the scale for both modes)."""
    return scale.float()
