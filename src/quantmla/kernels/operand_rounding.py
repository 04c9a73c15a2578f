"""Tensor-core operand rounding, simulated in the fp32 references: what 8-bit products would cost in accuracy.

A decode kernel feeds the tensor cores rounded operands: the query of the score product (S = Q K^T) and the
probabilities of the output product (O = P V). The cached codes are exact in every format considered here (4- and
2-bit codes are small integers, exact in e4m3, int8, fp16 and bf16); the query and the probabilities are not. Our
kernels use 16-bit operands; 8-bit ones (FP8 e4m3 or int8 wgmma) double the tensor cores' peak on Hopper, which is
the only way past BF16 FlashMLA by 2x where FlashMLA itself is compute-bound (64-128 heads: docs/kernels.md).

Inside :func:`simulated_operand_rounding`, :func:`quantmla.kernels.reference.decode_attention_torch` and
:func:`~quantmla.kernels.reference.prefill_attention_torch` round their operands as the named scheme does and return
the rounded result (so a whole model evaluated inside the context sees it end to end); with ``measure=True`` they
also compute the exact result and accumulate the relative L2 error of every call (:class:`RoundingStats`).

Schemes (``q``: the query [..., Dc + Dr]; ``p``: the softmax numerators exp(s - rowmax) in (0, 1]):

* ``fp32`` -- nothing rounded (the references' own math);
* ``bf16`` -- q and p rounded to bf16 (the 16-bit kernels' operands);
* ``e4m3-q`` -- q in FP8 e4m3 with one scale per (query, head, channel group) -- the group sizes of the cache
  format (content groups, then the RoPE groups) -- p in bf16: an FP8 score product, a 16-bit output product;
* ``e4m3`` -- that q, and p in e4m3 after multiplying by 256 (the row maximum 1 maps to 256 of e4m3's 448, so
  numerators down to 2^-17 stay representable instead of flushing below 2^-9); the row sums stay fp32, as a kernel
  accumulates them: both products in FP8;
* ``int8-q`` -- q in int8 (symmetric, per the same groups), p in bf16: an int8 score product;
* ``int8x2-q`` -- q as two int8 terms, ``s (h + l / 256)`` (h as ``int8-q``, l the residual's int8 on a 256x finer
  grid), p in bf16: two int8 score products (the 4- and 2-bit codes are exact int8), ~15 bits of q;
* ``int8-p`` -- q in bf16, p in int8 with one scale per (query, head, tile of 64 keys: a page), the tile's largest
  numerator mapped to 127: a 16-bit score product and an int8 output product (the codes are exact int8; session 32
  measured the output product as the costlier one, docs/kernels.md). A kernel's operand would be p times the
  token's content scale, rounded on the same per-tile grid; the scales' spread inside a tile is not simulated, and
  the sink and local-window tokens (BF16 in a kernel) are rounded like the rest.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

SCHEMES = ("fp32", "bf16", "e4m3-q", "e4m3", "int8-q", "int8x2-q", "int8-p")
E4M3_MAX = 448.0
P_SCALE = 256.0  # p in (0, 1] times this before the e4m3 cast
P_TILE = 64  # keys per int8 scale of p (int8-p): one page


@dataclass
class RoundingStats:
    """Relative L2 errors of the rounded vs exact outputs, one entry per reference call (``measure=True``)."""

    rel_l2: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        if not self.rel_l2:
            return {"calls": 0}
        t = torch.tensor(self.rel_l2, dtype=torch.float64)
        return {"calls": len(self.rel_l2), "median": t.median().item(), "max": t.max().item(), "mean": t.mean().item()}


@dataclass(frozen=True)
class _Active:
    scheme: str
    stats: RoundingStats | None


_ACTIVE: ContextVar[_Active | None] = ContextVar("quantmla_operand_rounding", default=None)


def _checked(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"operand rounding scheme must be one of {SCHEMES}, got {scheme!r}")
    return scheme


@contextlib.contextmanager
def simulated_operand_rounding(scheme: str, measure: bool = False):
    """Round the references' tensor-core operands as ``scheme`` does (one of :data:`SCHEMES`) inside the block;
    yields a :class:`RoundingStats` (filled only with ``measure=True``)."""
    _checked(scheme)
    stats = RoundingStats()
    token = _ACTIVE.set(_Active(scheme, stats if measure else None))
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


def active_scheme() -> str:
    """The scheme in force (``fp32`` outside any :func:`simulated_operand_rounding`)."""
    a = _ACTIVE.get()
    return "fp32" if a is None else a.scheme


def _group_bounds(dc: int, dr: int, content_group: int, rope_group: int) -> list[tuple[int, int]]:
    cg, rg = content_group or dc, rope_group or dr
    return [(a, min(a + cg, dc)) for a in range(0, dc, cg)] + [(dc + a, dc + min(a + rg, dr)) for a in range(0, dr, rg)]


def round_query(q: torch.Tensor, dc: int, content_group: int = 128, rope_group: int = 64, scheme: str | None = None):
    """``q`` [..., Dc + Dr] fp32 as the scheme's score product reads it (fp32 out). 8-bit schemes scale each
    channel group of each query row by its absolute maximum (an all-zero group stays zero)."""
    scheme = _checked(scheme or active_scheme())
    if scheme in ("fp32", "bf16", "int8-p"):
        return q if scheme == "fp32" else q.to(torch.bfloat16).float()
    out = torch.empty_like(q)
    top = E4M3_MAX if scheme.startswith("e4m3") else 127.0
    for a, b in _group_bounds(dc, q.shape[-1] - dc, content_group, rope_group):
        g = q[..., a:b]
        s = g.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
        if scheme.startswith("int8"):
            h = torch.round(g / s).clamp(-127, 127)
            if scheme == "int8x2-q":  # the residual (|r| <= s / 2) on the grid s / 256
                h = h + torch.round((g - h * s) / (s / 256)).clamp(-127, 127) / 256
            out[..., a:b] = h * s
        else:
            out[..., a:b] = (g / s).to(torch.float8_e4m3fn).float() * s
    return out


def round_probs(p: torch.Tensor, scheme: str | None = None) -> torch.Tensor:
    """Softmax numerators ``p`` in [0, 1] as the scheme's output product reads them (fp32 out)."""
    scheme = _checked(scheme or active_scheme())
    if scheme == "fp32":
        return p
    if scheme == "e4m3":
        return (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE
    if scheme == "int8-p":  # symmetric int8 per tile of P_TILE keys (the last one may be short); p >= 0
        n = p.shape[-1]
        t = torch.nn.functional.pad(p, (0, -n % P_TILE)).unflatten(-1, (-1, P_TILE))  # [..., tiles, P_TILE]
        step = t.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        return (torch.round(t / step).clamp(0, 127) * step).flatten(-2)[..., :n]
    return p.to(torch.bfloat16).float()


def rounded_attention(q: torch.Tensor, keys: torch.Tensor, scale: float, allowed: torch.Tensor | None, dc: int,
                      groups: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """``softmax(scale * q keys^T) keys[:, :dc]`` with the active scheme's operands: q [..., Dc + Dr], keys [S,
    Dc + Dr], allowed bool broadcastable to the scores (None: all). Rows with nothing allowed give 0. With a
    measuring scheme the exact result is computed too and the relative L2 error recorded."""
    a = _ACTIVE.get()
    out = _attention(q, keys, scale, allowed, dc, groups, a.scheme if a else "fp32")
    if a is not None and a.stats is not None and a.scheme != "fp32":
        ref = _attention(q, keys, scale, allowed, dc, groups, "fp32")
        n = ref.norm().item()
        if n > 0:
            a.stats.rel_l2.append((out - ref).norm().item() / n)
    return out


def _attention(q, keys, scale, allowed, dc, groups, scheme):
    qr = round_query(q, dc, *groups, scheme=scheme)
    s = qr @ keys.T * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    e = torch.exp(s - m)  # in [0, 1]; masked -> 0
    den = e.sum(dim=-1, keepdim=True)
    o = round_probs(e, scheme) @ keys[:, :dc]
    return torch.where(den > 0, o / den.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(o))
