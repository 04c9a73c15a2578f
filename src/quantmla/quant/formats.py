"""Named cache formats (BF16, C8R8, C4R4, C2R4, C4R8, ...) and the physical bytes of a whole cache.

A format pairs one :class:`QuantSpec` for the *content path* (the ``kv_lora_rank``-dim latent, 512 in
every shipped MLA model) with one for the *RoPE path* (the ``qk_rope_head_dim``-dim shared key, 64);
``None`` means the path is stored unquantized (2 bytes per value, BF16).

Per-token byte layout for the DeepSeek shapes (latent 512, RoPE 64), all little-endian:

=======  ===================================================================  ===========
format   per token and layer                                                  bytes
=======  ===================================================================  ===========
BF16     512 x bf16 content | 64 x bf16 RoPE                                  1152
C8R8     512 B int8 content | 4 x fp16 scale | 64 B int8 RoPE | 1 x fp16 scale  586
C4R8     256 B int4 content | 4 x (fp16 scale, fp16 min) | 64 B int8 RoPE |      338
         1 x fp16 scale
C4R4     256 B int4 content | 4 x (fp16 scale, fp16 min) | 32 B int4 RoPE |      308
         1 x (fp16 scale, fp16 min)
C2R4     128 B int2 content | 4 x (fp16 scale, fp16 min) | 32 B int4 RoPE |      180
         1 x (fp16 scale, fp16 min)
C4R4T    256 B int4 content | 1 x (fp16 scale, fp16 min) | 32 B int4 RoPE |      296
         1 x (fp16 scale, fp16 min)
C2R4T    128 B int2 content | 1 x (fp16 scale, fp16 min) | 32 B int4 RoPE |      168
         1 x (fp16 scale, fp16 min)
=======  ===================================================================  ===========

The ``T`` formats keep **one content scale and offset per token** (one group spanning the whole latent) instead of
one per 128 channels: 12 bytes less per token, and the Hopper decode kernel folds one content score and builds one
``(P s)^T`` tile per 64-token tile instead of four (1.09-1.10x faster at the long shapes in the session-26 spike,
docs/kernels.md). With transforms calibrated for it, the coarser scale costs no accuracy on the converted model
(benchmarks/results/content_groups_cpu_calibrated.md); with transforms learned for 128-channel groups it does.

Codes are packed in the planar layout of :mod:`quantmla.quant.packing`. Under the mixed-precision
policy every token also has its packed copy, and the first ``sink`` plus the last ``local`` tokens of
each sequence additionally live in BF16 buffers (``sink + local`` slots of 1152 B per sequence and
layer); :func:`cache_bytes` counts those, the page-granular allocation of the packed store and the
block table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from quantmla.quant.spec import QuantSpec

BF16_BYTES = 2


@dataclass(frozen=True)
class CacheFormat:
    """How the two MLA cache paths are stored. ``None`` for a path means BF16 (unquantized)."""

    name: str
    content: QuantSpec | None = None
    rope: QuantSpec | None = None

    def __post_init__(self) -> None:
        for label, s in (("content", self.content), ("rope", self.rope)):
            if s is not None and not isinstance(s, QuantSpec):
                raise TypeError(f"CacheFormat.{label} must be a QuantSpec or None, got {type(s).__name__}")

    @property
    def is_quantized(self) -> bool:
        return self.content is not None or self.rope is not None

    def check_dims(self, kv_lora_rank: int, rope_dim: int) -> None:
        """Raise a clear error if this format cannot store a latent/RoPE pair of these widths."""
        for label, s, w in (("content", self.content, kv_lora_rank), ("rope", self.rope, rope_dim)):
            if s is not None:
                try:
                    s.check_width(w)
                except ValueError as e:
                    raise ValueError(f"format {self.name!r}, {label} path (width {w}): {e}") from None

    def adapted(self, kv_lora_rank: int, rope_dim: int) -> CacheFormat:
        """This format for a model whose path widths are smaller than a default group: a group larger
        than its path (e.g. RoPE groups of 64 on MiniCPM3's 32-dim RoPE key) shrinks to the whole path.
        Groups that simply do not divide the width are left alone (``check_dims`` reports them)."""

        def fit(s: QuantSpec | None, w: int) -> QuantSpec | None:
            if s is None or w % s.group_size == 0 or s.group_size % w != 0:
                return s
            return replace(s, group_size=w)

        c, r = fit(self.content, kv_lora_rank), fit(self.rope, rope_dim)
        return self if (c, r) == (self.content, self.rope) else replace(self, content=c, rope=r)

    def path_bytes(self, which: str, width: int) -> int:
        s = self.content if which == "content" else self.rope
        return width * BF16_BYTES if s is None else s.bytes_per_token(width)

    def bytes_per_token(self, kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
        """Bytes of the (packed) store per token and layer, scales included."""
        self.check_dims(kv_lora_rank, rope_dim)
        return self.path_bytes("content", kv_lora_rank) + self.path_bytes("rope", rope_dim)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "content": None if self.content is None else self.content.to_dict(),
            "rope": None if self.rope is None else self.rope.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> CacheFormat:
        return cls(
            name=d["name"],
            content=None if d.get("content") is None else QuantSpec.from_dict(d["content"]),
            rope=None if d.get("rope") is None else QuantSpec.from_dict(d["rope"]),
        )


def _path_spec(bits: int, width_hint: str) -> QuantSpec | None:
    if bits == 16:
        return None
    if width_hint == "content":
        # 8 bit: symmetric is as good as asymmetric and saves the offsets.
        return QuantSpec(bits=bits, group_size=128, symmetric=bits == 8)
    return QuantSpec(bits=bits, group_size=64, symmetric=bits == 8)


TOKEN_GROUP = 512  # the content group of the ``T`` formats: DeepSeek's whole latent (``adapted`` shrinks it to a
# narrower model's latent, so it is one group per token on every shipped MLA model)


def make_format(content_bits: int, rope_bits: int, token_scale: bool = False) -> CacheFormat:
    """The default format ``C{content_bits}R{rope_bits}`` (16 = keep that path in BF16); ``token_scale``: one content
    scale (and offset) per token instead of one per 128 channels, the ``T`` formats (``c4r4t``)."""
    for label, b in (("content", content_bits), ("rope", rope_bits)):
        if b not in (2, 4, 8, 16):
            raise ValueError(f"{label} bits {b} not supported; choose 2, 4, 8 or 16 (16 = unquantized BF16)")
    if token_scale and content_bits == 16:
        raise ValueError("a per-token content scale needs a quantized content path (content bits 2, 4 or 8, not 16)")
    name = "bf16" if content_bits == rope_bits == 16 else f"c{content_bits}r{rope_bits}" + ("t" if token_scale else "")
    content = _path_spec(content_bits, "content")
    if token_scale:
        content = replace(content, group_size=TOKEN_GROUP)
    return CacheFormat(name, content, _path_spec(rope_bits, "rope"))


FORMATS: dict[str, CacheFormat] = {
    name: make_format(c, r)
    for name, (c, r) in {
        "bf16": (16, 16),
        "c8r8": (8, 8),
        "c4r8": (4, 8),
        "c4r4": (4, 4),
        "c2r4": (2, 4),
    }.items()
}
FORMATS["c4r4t"] = make_format(4, 4, token_scale=True)
FORMATS["c2r4t"] = make_format(2, 4, token_scale=True)

_NAME_RE = re.compile(r"^c(2|4|8|16)r(2|4|8|16)(t?)$")


def get_format(name: str | CacheFormat) -> CacheFormat:
    """Look a format up by name (case-insensitive): ``bf16``, ``c8r8``, ``c4r4``, ``c2r4``, ``c4r8``, ``c4r4t``,
    ``c2r4t`` or any ``c{2,4,8,16}r{2,4,8,16}``, with a trailing ``t`` for one content scale per token."""
    if isinstance(name, CacheFormat):
        return name
    key = str(name).strip().lower()
    if key in FORMATS:
        return FORMATS[key]
    m = _NAME_RE.match(key)
    if m:
        return make_format(int(m.group(1)), int(m.group(2)), token_scale=m.group(3) == "t")
    raise ValueError(
        f"unknown cache format {name!r}; choose one of {sorted(FORMATS)} or any c<bits>r<bits> with bits "
        "in 2, 4, 8, 16 (a trailing t: one content scale per token, e.g. c4r4t)"
    )


@dataclass(frozen=True)
class CachePolicy:
    """The mixed-precision policy: the first ``sink`` and the last ``local`` tokens of every sequence are
    also kept in full precision and attention reads them from there. ``page_size`` is the paged
    store's allocation unit (tokens per page)."""

    sink: int = 4
    local: int = 128
    page_size: int = 64

    def __post_init__(self) -> None:
        for label, v in (("sink", self.sink), ("local", self.local)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CachePolicy.{label} must be an integer >= 0, got {v!r}")
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"CachePolicy.page_size must be a positive integer, got {self.page_size!r}")

    def reads_full(self, q_pos, k_pos):
        """The policy itself: bool ``[Tq, S]``, True where the query at position ``q_pos[t]`` reads cached token
        ``k_pos[j]`` from its full-precision copy (``j < sink`` or ``j > t - local``), False where it reads the
        packed copy. Causality is not part of it (mask ``k_pos > q_pos`` separately). ``q_pos``/``k_pos``: 1-D
        integer tensors. Every attention path over the cache (torch reference, kernels) follows this rule."""
        q, k = q_pos[:, None], k_pos[None, :]
        return (k < self.sink) | (k > q - self.local)

    def packed_for_all(self, q0: int) -> range:
        """The cached positions that every query at position ``>= q0`` sees and reads from the packed copy: by
        :meth:`reads_full`, ``sink <= j <= q0 - local`` (the window only moves forward, and ``j <= q0 <= p``)."""
        return range(self.sink, max(self.sink, q0 - self.local + 1))


@dataclass(frozen=True)
class CacheBytes:
    """Physical bytes of a whole cache, by component (all layers, all sequences)."""

    format: str
    context: int
    batch: int
    num_layers: int
    packed: int
    scales: int
    bf16_buffers: int
    metadata: int
    extra: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.packed + self.scales + self.bf16_buffers + self.metadata

    @property
    def bytes_per_token(self) -> float:
        return self.total / max(1, self.context * self.batch * self.num_layers)


def cache_bytes(
    fmt: CacheFormat | str,
    *,
    kv_lora_rank: int,
    rope_dim: int,
    num_layers: int,
    context: int,
    batch: int = 1,
    policy: CachePolicy | None = None,
) -> CacheBytes:
    """Physical bytes of a cache holding ``batch`` sequences of ``context`` tokens.

    BF16: one BF16 store, page-granular. Quantized: the packed store (every token, page-granular,
    codes and scales), plus per sequence and layer ``min(sink + local, context)`` BF16 slots of
    ``(kv_lora_rank + rope_dim) * 2`` bytes, plus the block table (int32 per page per sequence, shared
    by all layers) and one int32 length per sequence.
    """
    fmt = get_format(fmt).adapted(kv_lora_rank, rope_dim)
    policy = policy or CachePolicy()
    if context < 0 or batch < 0 or num_layers <= 0:
        raise ValueError("context and batch must be >= 0 and num_layers > 0")
    fmt.check_dims(kv_lora_rank, rope_dim)
    pages = math.ceil(context / policy.page_size)
    slots = pages * policy.page_size  # allocated token slots per sequence
    codes_pt = scales_pt = 0
    for s, w in ((fmt.content, kv_lora_rank), (fmt.rope, rope_dim)):
        if s is None:
            codes_pt += w * BF16_BYTES
        else:
            codes_pt += s.code_bytes(w)
            scales_pt += s.scale_bytes(w)
    per_layer_seq_packed = slots * codes_pt
    per_layer_seq_scales = slots * scales_pt
    buffers = 0
    if fmt.is_quantized:
        buffers = min(policy.sink + policy.local, context) * (kv_lora_rank + rope_dim) * BF16_BYTES
    metadata = batch * (pages * 4 + 4)
    n = num_layers * batch
    return CacheBytes(
        format=fmt.name,
        context=context,
        batch=batch,
        num_layers=num_layers,
        packed=n * per_layer_seq_packed,
        scales=n * per_layer_seq_scales,
        bf16_buffers=n * buffers,
        metadata=metadata,
    )
