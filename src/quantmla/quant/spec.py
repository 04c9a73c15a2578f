"""QuantSpec: how one cache path (content latent or RoPE key) is quantized.

A path of width ``D`` is split into groups of ``group_size`` consecutive channels; each group of each
token gets its own scale (and, when asymmetric, its own offset), stored in ``scale_dtype``.
The integer codes are packed ``8 // bits`` to a byte (see :mod:`quantmla.quant.packing`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor dtype is needed, so `quantmla --help` stays light
    import torch

SUPPORTED_BITS = (2, 4, 8)
SCALE_DTYPES = ("fp16", "bf16")  # names of torch.float16 / torch.bfloat16


@dataclass(frozen=True)
class QuantSpec:
    """Group-wise integer quantization of one cache path.

    bits: 2, 4 or 8.
    group_size: channels sharing one scale; must divide the path width (checked by ``check_width``).
    symmetric: codes centred on zero with one scale per group (``x ~ (q - 2^(b-1)) * s``) when True;
        otherwise an offset per group (``x ~ q * s + m``, ``m`` the group minimum), as in KIVI.
    scale_dtype: ``"fp16"`` or ``"bf16"``: storage of the scale and the offset.
    """

    bits: int = 4
    group_size: int = 64
    symmetric: bool = False
    scale_dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(
                f"QuantSpec.bits={self.bits!r} is not supported; choose one of {SUPPORTED_BITS}"
            )
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"QuantSpec.group_size must be a positive integer, got {self.group_size!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"QuantSpec.scale_dtype={self.scale_dtype!r} is not supported; choose one of "
                f"{sorted(SCALE_DTYPES)}"
            )

    # -- layout -------------------------------------------------------------------------------
    @property
    def torch_scale_dtype(self) -> torch.dtype:
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.scale_dtype]

    @property
    def levels(self) -> int:
        return 1 << self.bits

    def check_width(self, width: int) -> None:
        """Raise a clear error unless this spec can quantize a path of ``width`` channels."""
        if width % self.group_size != 0:
            raise ValueError(
                f"group_size={self.group_size} does not divide the path width {width}; "
                f"pick a divisor of {width} (e.g. {_divisors_hint(width)})"
            )
        per_byte = 8 // self.bits
        if width % per_byte != 0:
            raise ValueError(f"width {width} is not a multiple of {per_byte} ({self.bits}-bit codes per byte)")

    def num_groups(self, width: int) -> int:
        self.check_width(width)
        return width // self.group_size

    def code_bytes(self, width: int) -> int:
        """Bytes of packed integer codes per token for a path of ``width`` channels."""
        self.check_width(width)
        return width * self.bits // 8

    def scale_bytes(self, width: int) -> int:
        """Bytes of scales (and offsets, if asymmetric) per token."""
        per_group = 2 if self.symmetric else 4  # fp16/bf16 scale (+ fp16/bf16 offset)
        return self.num_groups(width) * per_group

    def bytes_per_token(self, width: int) -> int:
        return self.code_bytes(width) + self.scale_bytes(width)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        unknown = set(d) - {"bits", "group_size", "symmetric", "scale_dtype"}
        if unknown:
            raise ValueError(f"unknown QuantSpec fields {sorted(unknown)}")
        return cls(**d)


def _divisors_hint(width: int) -> str:
    divs = [d for d in (16, 32, 64, 128, 256) if width % d == 0]
    return ", ".join(map(str, divs)) if divs else "1"
