"""Query-aware rounding of the RoPE key: the same codes' grid, rounded in an order that feeds each error forward.

What a cached RoPE key's rounding error costs is a logit error ``q . (k_hat - k)`` for every later query ``q``:
the expected cost is ``e^T H e`` with ``H`` the (attention-weighted) second moment of the rotated queries that
read the key, and on the converted models ``H`` is far from diagonal (off-diagonal mass 5-7x the diagonal's on
SmolLM2-MLA). Round-to-nearest minimizes ``|e|^2`` channel by channel and ignores that. This module rounds the
channels one at a time in a fixed order and, after each, moves its error onto the channels not yet rounded so the
remainder compensates it under ``H`` (the error-feedback rule of OBQ / GPTQ, applied to one cached row at write
time with a per-layer ``H`` fixed at calibration):

    for c in order:  code_c = RNE((w_c - o) / s) clamped;  e = w_c - (code_c s + o);  w -= e * F[c, :]

with ``F[c, c']`` (zero for channels already rounded) from the upper Cholesky factor ``U`` of ``H^-1`` in that
order: ``F[order[t], order[u]] = U[t, u] / U[t, t]`` for ``u > t``. The group scales and offsets are round-to-
nearest's own (the min / max of the row before feedback), so the bytes, the format and every decode kernel are
unchanged; only which of the two neighbouring codes a channel gets differs. The order is by decreasing
``H`` diagonal (the channels whose error costs most are rounded first, and the rest absorb it).

:class:`RopeRounding` is the plan of one layer (built by :func:`fit_rope_rounding` from ``H``);
:func:`quantize_codes_feedback` is the torch reference that the fused Triton writer reproduces bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.quant.quantize import quantize_codes
from quantmla.quant.spec import QuantSpec

ROPE_ROUNDING_ATTR = "quantmla_rope_rounding"  # an attention module's plan, attached when transforms are folded
DEFAULT_DAMP = 0.01  # ridge added to H / mean(diag H): keeps the Cholesky factor finite for a rank-deficient H


@dataclass(frozen=True, eq=False)
class RopeRounding:
    """One layer's rounding plan for a ``D``-channel RoPE key: ``order`` int64 [D] (a permutation), ``feedback``
    fp32 [D, D] (``F`` above: row ``c`` is zero at ``c`` and at every channel rounded before ``c``).

    ``rotation`` (optional, fp32 [D, D], orthogonal: the *post-RoPE rotation* ``U``): the cache stores the rounded
    codes of ``k_pe U`` instead of ``k_pe`` and every query reads it as ``q_pe U`` (``(q U) . (k U) = q . k``), so
    full-precision logits are unchanged for any orthogonal ``U``. Unlike the RoPE path's learned transforms it need
    not commute with RoPE (it acts after it, at write and read time: no weight folding), so it can mix frequency
    pairs and spread the key's energy over all channels, which is what the 4-bit grid needs (a random-sign
    Hadamard matrix: :func:`quantmla.calibrate.query_moments.hadamard_rotation`). ``order`` and ``feedback`` are
    then a plan for the rotated key, fitted to ``U^T H U`` (:func:`fit_rope_rounding` with ``rotation``). Where it
    acts: the cache's writers (:class:`~quantmla.kernels.paged.PagedMLACache` rotates ``k_pe`` before it quantizes
    or keeps a BF16 copy), the attention entry points (:mod:`quantmla.kernels.dispatch` rotates ``q_pe``), and
    whatever hands keys back in the model's coordinates (``PagedCacheLayer.read`` multiplies by ``U^T``)."""

    order: torch.Tensor
    feedback: torch.Tensor
    rotation: torch.Tensor | None = None

    def __post_init__(self) -> None:
        d = self.order.numel()
        if self.order.dim() != 1 or self.feedback.shape != (d, d):
            raise ValueError(f"a rounding plan needs order [D] and feedback [D, D], got "
                             f"{tuple(self.order.shape)} and {tuple(self.feedback.shape)}")  # fmt: skip
        if not torch.equal(self.order.sort().values.cpu(), torch.arange(d)):
            raise ValueError("a rounding plan's order must be a permutation of the channels 0..D-1")
        if self.rotation is not None:
            r = self.rotation.detach().to("cpu", torch.float64)
            if r.shape != (d, d):
                raise ValueError(f"a {d}-channel plan needs a [{d}, {d}] rotation, got {tuple(r.shape)}")
            err = float((r @ r.T - torch.eye(d, dtype=torch.float64)).abs().max())
            if not err < 1e-4:  # (also catches NaN)
                raise ValueError(f"the post-RoPE rotation must be orthogonal (|U U^T - I| = {err:.3g}): a "
                                 "non-orthogonal map would change the logits")  # fmt: skip

    def rotate(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x [..., D] U`` (``inverse``: ``x U^T``) in fp32, in ``x``'s dtype; the identity without a rotation. A
        key before it is stored, a query before it reads the cache; inverse: a stored key back in the model's
        coordinates."""
        if self.rotation is None:
            return x
        u = self.rotation.to(x.device, torch.float32)
        return (x.float() @ (u.T if inverse else u)).to(x.dtype)

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`rotate` inverse: ``x U^T``."""
        return self.rotate(x, inverse=True)

    @property
    def width(self) -> int:
        return self.order.numel()

    def permuted(self, perm: torch.Tensor | list[int]) -> RopeRounding:
        """This plan for keys whose channel ``j`` is this plan's channel ``perm[j]`` (``k_new = k[..., perm]``):
        the same roundings, renamed -- the codes of ``k[..., perm]`` are this plan's codes of ``k``, permuted, bit
        for bit (how the vLLM plugin serves a model whose cache stores the RoPE key rotate-half: vLLM's key is
        interleaved)."""
        perm = torch.as_tensor(perm, dtype=torch.int64, device=self.feedback.device)
        if perm.shape != self.order.shape or not torch.equal(perm.sort().values.cpu(), torch.arange(self.width)):
            raise ValueError(f"perm must be a permutation of the plan's {self.width} channels")
        if self.rotation is not None:  # k[..., perm] U[perm] = k U: the same stored channels, the same plan
            return RopeRounding(self.order, self.feedback, self.rotation[perm.to(self.rotation.device)].contiguous())
        inv = torch.argsort(perm)  # old channel c is new channel inv[c]
        return RopeRounding(inv[self.order.long()].to(self.order.dtype), self.feedback[perm][:, perm].contiguous())

    def to(self, device: torch.device | str) -> RopeRounding:
        """The plan with its tensors on ``device`` (``order`` int32 there, as the writer reads it)."""
        device = torch.device(device)
        if self.feedback.device == device and self.order.dtype == torch.int32:
            return self
        rot = None if self.rotation is None else self.rotation.to(device, torch.float32)
        order = self.order.to(device=device, dtype=torch.int32)
        return RopeRounding(order, self.feedback.to(device, torch.float32), rot)


def fit_rope_rounding(moment: torch.Tensor, damp: float = DEFAULT_DAMP, rotation: torch.Tensor | None = None
                      ) -> RopeRounding:  # fmt: skip
    """The plan for a query second moment ``moment`` [D, D] (symmetric, positive semi-definite; any positive scale):
    normalized to unit mean diagonal, ``damp`` added on the diagonal, factored in float64 on the CPU. ``rotation``:
    a post-RoPE rotation ``U`` [D, D] (see :class:`RopeRounding`): the plan rounds the rotated key, fitted to the
    rotated queries' moment ``U^T H U``."""
    h = moment.detach().to("cpu", torch.float64)
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"the query moment must be a square [D, D] matrix, got {tuple(h.shape)}")
    if rotation is not None:
        u = rotation.detach().to("cpu", torch.float64)
        if u.shape != h.shape:
            raise ValueError(f"a [{h.shape[0]}, {h.shape[0]}] moment needs a rotation of that shape, got "
                             f"{tuple(u.shape)}")  # fmt: skip
        h = u.T @ h @ u
    if not torch.isfinite(h).all():
        raise ValueError("the query moment has non-finite entries (NaN / inf in the calibration queries?)")
    mean = h.diagonal().mean()
    if not mean > 0:
        raise ValueError("the query moment has no positive diagonal: no calibration query reached this layer")
    if damp <= 0:
        raise ValueError(f"damp must be > 0 (a ridge on H / mean(diag H)), got {damp}")
    h = (h + h.T) / 2 / mean + damp * torch.eye(h.shape[0], dtype=torch.float64)
    order = torch.sort(h.diagonal(), descending=True, stable=True).indices
    hp = h[order][:, order]
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hp)), upper=True)  # U^T U = Hp^-1
    f = torch.triu(u / u.diagonal()[:, None], diagonal=1)  # [t, u]: U[t, u] / U[t, t] for u > t
    feedback = torch.zeros_like(f)
    feedback[order[:, None], order[None, :]] = f
    rot = None if rotation is None else rotation.detach().to("cpu", torch.float32).contiguous()
    return RopeRounding(order.to(torch.int64), feedback.to(torch.float32), rot)


def quantize_codes_feedback(
    x: torch.Tensor, spec: QuantSpec, plan: RopeRounding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`~quantmla.quant.quantize.quantize_codes` of ``x [..., D]`` with the channels rounded in ``plan``'s
    order and each error fed forward: the same (scale, offset), other codes. fp32, one operation at a time (the
    Triton writer rounds the same way, no fused multiply-adds). A non-finite error (a NaN group) feeds nothing."""
    d = x.shape[-1]
    if plan.width != d:
        raise ValueError(f"a rounding plan for {plan.width} channels cannot round a {d}-channel RoPE key")
    codes, scale, offset = quantize_codes(x, spec)
    g = spec.group_size
    lead = x.shape[:-1]
    w = x.float().reshape(-1, d).clone()  # [N, D]
    s = scale.float().reshape(-1, d // g).repeat_interleave(g, dim=-1)  # [N, D]
    o = None if offset is None else offset.float().reshape(-1, d // g).repeat_interleave(g, dim=-1)
    fb = plan.feedback.to(w.device, torch.float32)
    q = torch.zeros_like(w)
    for c in plan.order.tolist():
        wc, sc = w[:, c], s[:, c]
        if spec.symmetric:
            qmax = (1 << (spec.bits - 1)) - 1
            qc = torch.round(wc / sc).clamp_(-qmax, qmax).nan_to_num_(nan=0.0)
            deq = qc * sc
        else:
            qc = torch.round((wc - o[:, c]) / sc).clamp_(0, (1 << spec.bits) - 1).nan_to_num_(nan=0.0)
            deq = qc * sc + o[:, c]
        q[:, c] = qc
        e = wc - deq
        e = torch.where(torch.isfinite(e), e, torch.zeros_like(e))
        w -= e[:, None] * fb[c][None, :]
    if spec.symmetric:
        q = q + (1 << (spec.bits - 1))
    return q.to(torch.uint8).reshape(*lead, d), scale, offset


__all__ = ["DEFAULT_DAMP", "ROPE_ROUNDING_ATTR", "RopeRounding", "fit_rope_rounding", "quantize_codes_feedback"]
