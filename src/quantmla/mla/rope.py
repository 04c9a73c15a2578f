"""Our own rotary position embedding (RoPE) for the decoupled RoPE path of MLA.

MLA rotates only the ``qk_rope_head_dim`` (Dr) RoPE columns of the query and the shared RoPE key. Two things
vary across the supported families and both matter to a cache that stores ``k_pe``:

* the *input pairing* (``MLASpec.rope_pairing``): which columns form a rotation pair. ``"interleaved"`` pairs
  columns (2i, 2i+1) -- DeepSeek-V2 (complex multiply) and DeepSeek-V3 / GLM / LongCat with
  ``rope_interleave=True``; ``"half"`` pairs columns (i, i + Dr/2) -- ``rotate_half``;
* the *output layout* (``MLASpec.rope_cache_pairing``): DeepSeek-V2's complex multiply keeps pairs
  interleaved in the rotated key, while transformers' ``apply_rotary_pos_emb_interleave`` (V3, GLM, LongCat)
  writes the rotated key de-interleaved (all first members, then all second members), i.e. ``"half"``.

The attention logits ``q_pe . k_pe`` are identical either way; what differs is the column order of the cached
``k_pe`` (and so where a per-frequency 2x2 transform acts on it).

Frequencies: ``"default"`` (``theta^(-2i/Dr)``) and ``"yarn"`` (NTK-by-parts interpolation with the YaRN
attention factor that transformers multiplies into cos and sin). Angles are returned per pair:
``cos``/``sin`` of shape [..., T, Dr/2].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

PAIRINGS = ("interleaved", "half")
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """The RoPE parameters of an MLA model (a flattened, hashable view of transformers' ``rope_parameters``)."""

    dim: int  # qk_rope_head_dim (Dr)
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    frequency_dim: int | None = None  # quantmla_mla: frequencies of a head this wide, tiled (default RoPE only)

    def __post_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE dim must be a positive even number, got {self.dim}")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")

    @classmethod
    def from_config(cls, config: Any) -> RopeConfig:
        """Read from a transformers config object or a plain dict of one (config.json)."""
        get = _getter(config)
        rp = dict(get("rope_parameters") or get("rope_scaling") or {})
        rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
        theta = rp.get("rope_theta", get("rope_theta", 10000.0))
        return cls(
            dim=int(get("qk_rope_head_dim")),
            theta=float(theta),
            rope_type=str(rtype),
            factor=_opt_float(rp.get("factor")),
            original_max_position_embeddings=_opt_int(rp.get("original_max_position_embeddings")),
            max_position_embeddings=_opt_int(get("max_position_embeddings")),
            beta_fast=_opt_float(rp.get("beta_fast")),
            beta_slow=_opt_float(rp.get("beta_slow")),
            mscale=_opt_float(rp.get("mscale")),
            mscale_all_dim=_opt_float(rp.get("mscale_all_dim")),
            attention_factor=_opt_float(rp.get("attention_factor")),
            truncate=bool(rp.get("truncate", True)),
            partial_rotary_factor=float(rp.get("partial_rotary_factor", 1.0)),
            frequency_dim=_opt_int(get("rope_frequency_dim")),
        )


def _getter(config: Any):
    if isinstance(config, dict):
        return lambda k, d=None: config.get(k, d)
    return lambda k, d=None: getattr(config, k, d)


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(rc: RopeConfig) -> float:
    if rc.factor is not None:
        return rc.factor
    if rc.max_position_embeddings and rc.original_max_position_embeddings:
        return rc.max_position_embeddings / rc.original_max_position_embeddings
    raise ValueError("YaRN RoPE needs `factor` or both max_position_embeddings and original_max_position_embeddings")


def rope_attention_factor(rc: RopeConfig) -> float:
    """The factor multiplied into cos and sin (1 for default RoPE; the YaRN mscale ratio for YaRN)."""
    if rc.rope_type == "default":
        return 1.0
    _check_type(rc)
    if rc.attention_factor is not None:
        return rc.attention_factor
    factor = _yarn_factor(rc)
    if rc.mscale and rc.mscale_all_dim:
        return float(_yarn_get_mscale(factor, rc.mscale) / _yarn_get_mscale(factor, rc.mscale_all_dim))
    return _yarn_get_mscale(factor)


def _check_type(rc: RopeConfig) -> None:
    if rc.rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rc.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def rope_inv_freq(rc: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [Dr/2] (fp32), one per rotation pair."""
    _check_type(rc)
    if rc.frequency_dim:
        if rc.rope_type != "default" or rc.dim % rc.frequency_dim:
            raise ValueError(f"frequency_dim={rc.frequency_dim} needs default RoPE and to divide dim={rc.dim}")
        sub = replace(rc, dim=rc.frequency_dim, frequency_dim=None)
        return rope_inv_freq(sub).repeat(rc.dim // rc.frequency_dim)  # [Dr/2]
    dim = int(rc.dim * rc.partial_rotary_factor)
    pos_freqs = rc.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [Dr/2]
    if rc.rope_type == "default":
        return 1.0 / pos_freqs
    return _yarn_inv_freq(rc, pos_freqs, dim)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(rc: RopeConfig, pos_freqs: torch.Tensor, dim: int) -> torch.Tensor:
    """NTK-by-parts: extrapolate the high frequencies, interpolate (divide by factor) the low ones, ramp between."""
    if rc.original_max_position_embeddings is None:
        raise ValueError("YaRN RoPE needs rope_parameters['original_max_position_embeddings']")
    factor = _yarn_factor(rc)
    beta_fast, beta_slow = rc.beta_fast or 32.0, rc.beta_slow or 1.0
    omax = rc.original_max_position_embeddings
    low = _yarn_correction_dim(beta_fast, dim, rc.theta, omax)
    high = _yarn_correction_dim(beta_slow, dim, rc.theta, omax)
    if rc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [Dr/2]
    extrapolation = 1 - ramp  # 1 = keep the original frequency
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    return inv_inter * (1 - extrapolation) + inv_extra * extrapolation


def rope_cos_sin(rc: RopeConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ``cos``/``sin`` [..., T, Dr/2] (fp32) for integer ``positions`` [..., T], attention factor included."""
    inv_freq = rope_inv_freq(rc).to(positions.device)  # [Dr/2]
    angles = positions[..., None].float() * inv_freq  # [..., T, Dr/2]
    af = rope_attention_factor(rc)
    return angles.cos() * af, angles.sin() * af


def cos_sin_from_position_embeddings(position_embeddings: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ``cos``/``sin`` [B, T, Dr/2] from what a transformers MLA model passes to its attention.

    DeepSeek-V2 passes complex ``freqs_cis`` [B, T, Dr/2]; DeepSeek-V3, GLM and LongCat pass ``(cos, sin)``, each
    [B, T, Dr] = ``cat(angles, angles)``.
    """
    if isinstance(position_embeddings, torch.Tensor):
        if not position_embeddings.is_complex():
            raise TypeError("a tensor position embedding must be complex freqs_cis (DeepSeek-V2)")
        return position_embeddings.real, position_embeddings.imag
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    return cos[..., :half], sin[..., :half]


def _split_pairs(x: torch.Tensor, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    if pairing == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    if pairing == "half":
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]
    raise ValueError(f"unknown RoPE pairing {pairing!r}; expected one of {PAIRINGS}")


def _join_pairs(a: torch.Tensor, b: torch.Tensor, pairing: str) -> torch.Tensor:
    if pairing == "interleaved":
        return torch.stack((a, b), dim=-1).flatten(-2)
    if pairing == "half":
        return torch.cat((a, b), dim=-1)
    raise ValueError(f"unknown RoPE pairing {pairing!r}; expected one of {PAIRINGS}")


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pairing: str,
    out_pairing: str | None = None,
) -> torch.Tensor:
    """Rotate ``x`` [..., Dr] by per-pair angles; ``cos``/``sin`` broadcast to [..., Dr/2].

    ``pairing`` says which input columns form a pair, ``out_pairing`` (default: the same) how the rotated pairs
    are laid out in the output. The computation runs in ``x``'s dtype.
    """
    x1, x2 = _split_pairs(x, pairing)  # [..., Dr/2] each
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    return _join_pairs(r1, r2, out_pairing or pairing)
