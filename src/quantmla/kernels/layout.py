"""Byte layout of the paged packed MLA cache: one page of ``P`` tokens, and the BF16 buffers beside the pool.

Every token of every sequence gets a packed copy in a fixed-size *page* of ``P`` tokens (``P =
CachePolicy.page_size``, 64 by default); a sequence's pages are listed in its row of the block table.
Under the mixed-precision policy the first ``sink`` tokens are also kept in a BF16 sink buffer and the
last ``local`` tokens in a BF16 ring buffer (slot = position % local); attention reads those tokens
from BF16 and all others from their packed copy. The BF16 format has no buffers: its pages hold BF16.

Byte layout of one page (all offsets 16-byte aligned; every region starts at a multiple of 16 bytes
and is padded to one), for a format with content spec ``Sc`` (width ``Dc``) and RoPE spec ``Sr``
(width ``Dr``)::

    [ content codes  P x Cb  uint8 ]  token-major: row t = the Cb packed bytes of token t
    [ RoPE codes     P x Rb  uint8 ]  token-major, Rb bytes per token

Within a token row the content codes are packed *grouped planar* (:func:`quantmla.quant.packing.pack` with ``group``
= the content *packing group*: the quantization group, or 128 channels when the quantization group is a multiple of
128 -- the ``T`` formats' one group per token keeps C4R4's packing): each packing group of ``G`` channels owns ``G *
bits / 8`` consecutive bytes, and byte ``j`` of group ``g`` holds channel ``g*G + j + p*G*bits/8`` in bits
``[p*bits, (p+1)*bits)``, so every 16-byte chunk of a row belongs to one group (what the CUDA decode kernel needs to
give each warp one group). The RoPE codes are packed *plain planar* (``group=None``: byte ``j`` holds channel ``j +
p*Dr*bits/8``), so each bit plane is a run of whole RoPE groups (what the Triton decode kernel reads: one scale row
per plane). For one RoPE group (DeepSeek's 64 dims) and for 8-bit codes the two packings are the same bytes.
:meth:`PagedLayout.pack_group` says which; the torch writer/reader and the Triton writer all take it from there.
    [ meta           M x P   fp16  ]  group-major: row r = one scale (or offset) for each of the P tokens

``Cb = Dc * bits_c / 8`` (planar packing of :mod:`quantmla.quant.packing`; ``Dc * 2`` BF16 bytes when the
path is unquantized), likewise ``Rb``. Meta rows, in order: content scales (``Dc / g_c`` rows), content
offsets (same count, asymmetric specs only), RoPE scales (``Dr / g_r``), RoPE offsets (asymmetric only).
Group-major meta makes the scale of one group for a whole tile of tokens one contiguous vector.

DeepSeek shapes (Dc = 512, Dr = 64), P = 64:

=======  ==========================  ===================  ===============  ==========  =========
format   content codes (P x Cb)      RoPE codes (P x Rb)  meta (M x P)     page bytes  per token
=======  ==========================  ===================  ===============  ==========  =========
BF16     64 x 1024 (bf16)            64 x 128 (bf16)      --               73728       1152
C8R8     64 x 512                    64 x 64              5 x 64 fp16      37504       586
C4R8     64 x 256                    64 x 64              9 x 64 fp16      21632       338
C4R4     64 x 256                    64 x 32              10 x 64 fp16     19712       308
C2R4     64 x 128                    64 x 32              10 x 64 fp16     11520       180
C4R4T    64 x 256                    64 x 32              4 x 64 fp16      18944       296
C2R4T    64 x 128                    64 x 32              4 x 64 fp16      10752       168
=======  ==========================  ===================  ===============  ==========  =========

C4R4 meta rows: 4 content scales, 4 content offsets (groups of 128), 1 RoPE scale, 1 RoPE offset.
C8R8 meta rows (symmetric, no offsets): 4 content scales, 1 RoPE scale. C4R4T / C2R4T meta rows: 1 content scale,
1 content offset, 1 RoPE scale, 1 RoPE offset.

Beside the pool: block table ``[B, max_pages]`` int32, sequence lengths ``[B]`` int32, and for a
quantized format the BF16 buffers ``sink [B, sink, Dc + Dr]`` and ``local [B, local, Dc + Dr]`` (1152 B
per slot): per sequence ``(sink + local) * 1152`` bytes, 150,528 B for sink 4 / local 128.

:class:`~quantmla.kernels.paged.PagedMLACache` owns these tensors; this module only computes where bytes go.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.quant.formats import CacheFormat, CachePolicy
from quantmla.quant.spec import QuantSpec

_ALIGN = 16
CONTENT_PACK_GROUP = 128  # the widest content packing group: what the CUDA kernels' fragments are built for


def content_pack_group(spec: QuantSpec) -> int:
    """Channels per packing group of a content row: the quantization group, or :data:`CONTENT_PACK_GROUP` when the
    group is a multiple of it (a wider scale group does not change where the codes sit)."""
    g = spec.group_size
    return CONTENT_PACK_GROUP if g > CONTENT_PACK_GROUP and g % CONTENT_PACK_GROUP == 0 else g


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class PagedLayout:
    """Byte layout of one page of the packed store (see the module docstring)."""

    fmt: CacheFormat
    kv_lora_rank: int = 512
    rope_dim: int = 64
    page_size: int = 64

    def __post_init__(self) -> None:
        self.fmt.check_dims(self.kv_lora_rank, self.rope_dim)
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    # -- per-token widths -----------------------------------------------------------------------
    @staticmethod
    def _code_bytes(spec: QuantSpec | None, width: int) -> int:
        return width * 2 if spec is None else spec.code_bytes(width)

    def pack_group(self, which: str) -> int | None:
        """The ``group`` argument of :func:`quantmla.quant.packing.pack` for a path's token rows: the content
        packing group (:func:`content_pack_group`, grouped planar) or ``None`` for RoPE (plain planar)."""
        if which not in ("content", "rope"):
            raise ValueError(f"path must be 'content' or 'rope', got {which!r}")
        spec = self.fmt.content if which == "content" else self.fmt.rope
        return None if spec is None or which == "rope" else content_pack_group(spec)

    @staticmethod
    def _meta_rows(spec: QuantSpec | None, width: int) -> tuple[int, int]:
        """(scale rows, offset rows) of one path."""
        if spec is None:
            return 0, 0
        g = spec.num_groups(width)
        return g, 0 if spec.symmetric else g

    @property
    def content_bytes(self) -> int:  # Cb
        return self._code_bytes(self.fmt.content, self.kv_lora_rank)

    @property
    def rope_bytes(self) -> int:  # Rb
        return self._code_bytes(self.fmt.rope, self.rope_dim)

    @property
    def content_scale_row(self) -> int:
        return 0

    @property
    def content_offset_row(self) -> int:
        return self._meta_rows(self.fmt.content, self.kv_lora_rank)[0]

    @property
    def rope_scale_row(self) -> int:
        return sum(self._meta_rows(self.fmt.content, self.kv_lora_rank))

    @property
    def rope_offset_row(self) -> int:
        return self.rope_scale_row + self._meta_rows(self.fmt.rope, self.rope_dim)[0]

    @property
    def meta_rows(self) -> int:  # M
        return self.rope_scale_row + sum(self._meta_rows(self.fmt.rope, self.rope_dim))

    # -- offsets within a page (bytes) ----------------------------------------------------------
    @property
    def content_offset(self) -> int:
        return 0

    @property
    def rope_offset(self) -> int:
        return _align(self.page_size * self.content_bytes)

    @property
    def meta_offset(self) -> int:
        return self.rope_offset + _align(self.page_size * self.rope_bytes)

    @property
    def page_bytes(self) -> int:
        return self.meta_offset + _align(self.meta_rows * self.page_size * 2)

    def bytes_per_token(self) -> float:
        """Bytes of the packed store per token (page bytes / page size; equals the format's
        ``bytes_per_token`` whenever no region needs alignment padding, as for all named formats)."""
        return self.page_bytes / self.page_size

    @property
    def bf16_slot_bytes(self) -> int:
        return (self.kv_lora_rank + self.rope_dim) * 2


def buffer_slots(fmt: CacheFormat, policy: CachePolicy, capacity: int) -> tuple[int, int]:
    """(sink slots, local slots) of a cache holding at most ``capacity`` tokens per sequence: the policy's sizes,
    capped at the capacity (a window longer than any sequence reads the same tokens), 0 for the BF16 format."""
    if not fmt.is_quantized:
        return 0, 0
    return min(policy.sink, capacity), min(policy.local, capacity)
