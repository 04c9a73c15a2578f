"""Bit packing of integer codes into bytes, in the *planar* layout every quantmla kernel reads.

For ``b``-bit codes there are ``k = 8 // b`` codes per byte. A row of ``D`` codes is cut into ``k``
contiguous planes of ``D / k`` channels; byte ``j`` holds channel ``j + p * D/k`` of plane ``p`` in bits
``[p*b, (p+1)*b)``. For 4 bits: byte ``j`` = channel ``j`` (low nibble) | channel ``j + D/2`` (high
nibble). A kernel therefore unpacks a tile with one shift and one mask per plane and never has to
interleave registers: plane ``p`` is simply channels ``[p*D/k, (p+1)*D/k)``.

*Grouped* planar packing (``group=G``, what the paged cache stores): the row is cut into groups of ``G``
channels (the quantization groups) and each group is packed planar on its own into ``G*b/8`` consecutive
bytes: byte ``j`` of group ``g`` holds channel ``g*G + j + p*G/k`` in bits ``[p*b, (p+1)*b)``. Every byte
then belongs to exactly one quantization group, so a kernel that splits the latent across warps by group
reads only its own bytes. ``group=None`` (or ``G = D``) is the plain planar layout above; 8-bit codes are
the same in both.
"""

from __future__ import annotations

import torch


def _check(bits: int, width: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes; supported widths are 1, 2, 4 and 8 bits")
    per = 8 // bits
    if width % per != 0:
        raise ValueError(f"last dimension {width} is not a multiple of {per} ({bits}-bit codes per byte)")
    return per


def _check_group(width: int, group: int | None, per: int) -> int:
    """The group size to pack by (``width`` when ``group`` is None)."""
    if group is None:
        return width
    if group <= 0 or width % group or group % per:
        raise ValueError(f"group {group} must divide the row width {width} and be a multiple of {per} codes per byte")
    return group


def pack(codes: torch.Tensor, bits: int, group: int | None = None) -> torch.Tensor:
    """Pack unsigned integer codes ``[..., D]`` (values in ``[0, 2^bits)``) into uint8 ``[..., D*bits/8]``,
    planar over the whole row (``group=None``) or within each group of ``group`` channels."""
    per = _check(bits, codes.shape[-1])
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if per == 1:
        return codes.contiguous()
    g = _check_group(codes.shape[-1], group, per)
    if g != codes.shape[-1]:
        grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // g, g)  # [..., D/G, G]
        return pack(grouped, bits).reshape(*codes.shape[:-1], codes.shape[-1] * bits // 8)
    planes = codes.reshape(*codes.shape[:-1], per, codes.shape[-1] // per)  # [..., per, D/per]
    out = torch.zeros(planes.shape[:-2] + planes.shape[-1:], dtype=torch.uint8, device=codes.device)
    for p in range(per):
        out |= planes[..., p, :] << (p * bits)
    return out


def unpack(packed: torch.Tensor, bits: int, width: int, group: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., width*bits/8]`` -> uint8 codes ``[..., width]``."""
    per = _check(bits, width)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != width // per:
        raise ValueError(
            f"packed last dimension is {packed.shape[-1]} bytes but {width} {bits}-bit codes need {width // per}"
        )
    if per == 1:
        return packed.contiguous()
    g = _check_group(width, group, per)
    if g != width:
        grouped = packed.reshape(*packed.shape[:-1], width // g, g // per)  # [..., D/G, G*b/8]
        return unpack(grouped, bits, g).reshape(*packed.shape[:-1], width)
    mask = (1 << bits) - 1
    planes = [(packed >> (p * bits)) & mask for p in range(per)]
    return torch.cat(planes, dim=-1)
