"""The two transform families of QuantMLA: maps of the cached tensors that leave full precision unchanged.

Content path (the latent ``c`` [.., Dc] that the cache stores). The cache stores ``c T`` and ``T^-1`` is folded
into the up-projections that read the latent (``kv_b_proj`` = [W_UK; W_UV]), so keys and values are unchanged.
What else T may be depends on the layout that *writes* the latent:

* **no latent norm** (``quantmla_mla`` with ``latent_norm=False``): ``c = h W_lat^T + b``, so *any* invertible T
  folds into the latent rows of ``kv_a_proj_with_mqa`` (``W_lat <- T^T W_lat``, ``b <- b T``).
* **latent RMSNorm** (every DeepSeek-style model): ``c = s * rmsnorm(x) * g`` with ``x = h W_lat^T`` the
  pre-norm latent, ``g`` the norm gain and ``s`` a scalar (LongCat-Flash's ``mla_scale_kv_lora``; 1 elsewhere).
  RMSNorm commutes with an orthogonal ``Q`` (``rms(x Q) = rms(x)``), a scalar commutes with everything, and the
  gain is the only per-channel freedom, so the transforms that fold *exactly* are
  ``T = diag(g)^-1 Q diag(g')``: rotate the pre-norm rows (``W_lat <- Q^T W_lat``) and replace the gain by
  ``g'``. (A general T would need the norm to act on ``x T``, whose RMS differs from ``x``'s.)

Both are written here as ``T = diag(u) Q diag(v)`` with ``Q`` orthogonal: with a latent norm ``u = 1 / g`` is fixed
and ``v = g'`` is the new gain; without one ``u`` and ``v`` are free (per-channel smoothing before and after the
rotation). ``Q = Q0 cayley(A - A^T)`` (``Q0`` a fixed start, e.g. a Hadamard matrix; ``cayley(S) =
(I - S)^-1 (I + S)`` is orthogonal for every skew-symmetric S), ``u = u0 exp(a)``,
``v = v0 exp(b)`` -- every parameter value is a member of the family, so learning never leaves it.

RoPE path (the rotated shared key ``k_pe`` [.., Dr]). RoPE rotates each frequency pair ``(x1, x2)`` by an angle
that depends on the position: complex multiplication by ``e^{i theta_p}``. The per-pair linear maps commuting
with every such rotation are the complex multiplications ``z_p = s_p e^{i phi_p}`` (a 2x2 scale-and-rotation).
The cache stores ``k_pe z`` (folded into the RoPE rows of ``kv_a_proj_with_mqa``, before RoPE, which is the same
thing because they commute) and the query's RoPE columns get the inverse-transpose ``z / |z|^2`` so that
``Re(q conj(k))`` -- i.e. ``q_pe . k_pe`` -- is unchanged. The pair of frequency ``p`` sits in columns
``(2p, 2p+1)`` ("interleaved") or ``(p, p + Dr/2)`` ("half"); which one depends on the family and on whether the
tensor is taken before RoPE (``MLASpec.rope_pairing``) or after it (``MLASpec.rope_cache_pairing``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAIRINGS = ("interleaved", "half")


# ---- helpers -------------------------------------------------------------------------------------------------


def hadamard(n: int, seed: int | None = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An orthogonal ``n x n`` Hadamard-like matrix.

    For ``n`` a power of two: the Sylvester Hadamard matrix ``/ sqrt(n)`` with its columns multiplied by random
    signs (``seed``; ``None`` = no signs), as in QuaRot. Otherwise (no Sylvester matrix exists): a random
    orthogonal matrix from the QR decomposition of a seeded Gaussian matrix.
    """
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    if n > 0 and n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=dtype)
        while h.shape[0] < n:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        h = h / math.sqrt(n)
        if seed is not None:
            signs = torch.randint(0, 2, (n,), generator=gen).to(dtype) * 2 - 1
            h = h * signs
        return h
    return random_orthogonal(n, gen, dtype)


def random_orthogonal(n: int, gen: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A Haar-random orthogonal ``n x n`` matrix (QR of a Gaussian matrix with the sign fix)."""
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(dtype)


def split_pairs(x: torch.Tensor, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of every frequency pair: ``x`` [..., Dr] -> two [..., Dr/2]."""
    if pairing == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    if pairing == "half":
        h = x.shape[-1] // 2
        return x[..., :h], x[..., h:]
    raise ValueError(f"unknown RoPE pairing {pairing!r}; expected one of {PAIRINGS}")


def join_pairs(a: torch.Tensor, b: torch.Tensor, pairing: str) -> torch.Tensor:
    """Inverse of :func:`split_pairs`."""
    if pairing == "interleaved":
        return torch.stack((a, b), dim=-1).flatten(-2)
    if pairing == "half":
        return torch.cat((a, b), dim=-1)
    raise ValueError(f"unknown RoPE pairing {pairing!r}; expected one of {PAIRINGS}")


def complex_pair_mul(x: torch.Tensor, re: torch.Tensor, im: torch.Tensor, pairing: str) -> torch.Tensor:
    """Multiply every frequency pair ``p`` of ``x`` [..., Dr] (as ``x1 + i x2``) by ``re[p] + i im[p]`` [Dr/2]."""
    x1, x2 = split_pairs(x, pairing)
    return join_pairs(x1 * re - x2 * im, x1 * im + x2 * re, pairing)


# ---- content -------------------------------------------------------------------------------------------------


class ContentTransform(nn.Module):
    """``T = diag(u) Q diag(v)`` on the latent, ``Q = Q0 cayley(A - A^T)`` orthogonal (see the module docstring).

    ``u0`` [Dc], ``q0`` [Dc, Dc] (orthogonal), ``v0`` [Dc] are the fixed starting point; the parameters are the
    generator ``A`` and the log-scales ``log_u``/``log_v``, all zero at the start (so ``T = T0``).
    ``learn_u=False`` pins ``u`` (required with a latent norm, where ``u = 1 / g``).
    """

    def __init__(
        self,
        u0: torch.Tensor,
        q0: torch.Tensor,
        v0: torch.Tensor,
        *,
        learn_rotation: bool = True,
        learn_u: bool = False,
        learn_v: bool = True,
    ) -> None:
        super().__init__()
        dc = u0.shape[0]
        if q0.shape != (dc, dc) or v0.shape != (dc,):
            raise ValueError(f"ContentTransform: u0 [{dc}], q0 [{dc}, {dc}], v0 [{dc}] expected")
        self.register_buffer("u0", u0.detach().double().clone())
        self.register_buffer("q0", q0.detach().double().clone())
        self.register_buffer("v0", v0.detach().double().clone())
        self.gen = nn.Parameter(torch.zeros(dc, dc, dtype=torch.float32), requires_grad=learn_rotation)
        self.log_u = nn.Parameter(torch.zeros(dc, dtype=torch.float32), requires_grad=learn_u)
        self.log_v = nn.Parameter(torch.zeros(dc, dtype=torch.float32), requires_grad=learn_v)

    @property
    def dim(self) -> int:
        return self.u0.shape[0]

    def factors(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(u [Dc], Q [Dc, Dc], v [Dc])`` in ``dtype`` (differentiable)."""
        q = self.q0.to(dtype)
        if self.gen.requires_grad or bool(self.gen.detach().abs().max() > 0):
            a = self.gen.to(dtype)
            skew = a - a.T
            eye = torch.eye(a.shape[0], dtype=dtype, device=a.device)
            # Cayley: cheaper than matrix_exp, same family; I - skew is never singular (skew-symmetric), so solve_ex
            # without its error check: linalg.solve's check reads the LU status back, a host wait every step on a GPU
            q = q @ torch.linalg.solve_ex(eye - skew, eye + skew, check_errors=False)[0]
        u = self.u0.to(dtype) * torch.exp(self.log_u.to(dtype))
        v = self.v0.to(dtype) * torch.exp(self.log_v.to(dtype))
        return u, q, v

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``T`` [Dc, Dc]."""
        u, q, v = self.factors(dtype)
        return u[:, None] * q * v[None, :]

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        """``c T`` for ``c`` [..., Dc]."""
        u, q, v = self.factors(c.dtype)
        return ((c * u) @ q) * v

    def inverse(self, ct: torch.Tensor) -> torch.Tensor:
        """``ct T^-1`` for ``ct`` [..., Dc]."""
        u, q, v = self.factors(ct.dtype)
        return ((ct / v) @ q.T) / u

    def roundtrip(self, c: torch.Tensor, fn) -> torch.Tensor:
        """``fn(c T) T^-1`` for ``c`` [..., Dc], computing the factors once (``fn`` e.g. a quantize-dequantize)."""
        u, q, v = self.factors(c.dtype)
        return ((fn(((c * u) @ q) * v) / v) @ q.T) / u

    def learnable(self, rotation: bool = True, scales: bool = True) -> ContentTransform:
        """A fresh copy starting at this transform's current value, with the chosen parameters learnable.
        (``u`` stays pinned when it was pinned, i.e. with a latent norm.)"""
        u, q, v = (x.detach().double() for x in self.factors(torch.float64))
        return ContentTransform(
            u, q, v, learn_rotation=rotation, learn_u=scales and self.log_u.requires_grad, learn_v=scales
        )

    @classmethod
    def identity(cls, dc: int, norm_gain: torch.Tensor | None = None, **kw) -> ContentTransform:
        """``T = I`` in the family of a layout (``norm_gain`` = the latent norm's gain, None without a norm)."""
        q0 = torch.eye(dc, dtype=torch.float64)
        if norm_gain is None:
            return cls(torch.ones(dc), q0, torch.ones(dc), learn_u=kw.pop("learn_u", True), **kw)
        g = _check_gain(norm_gain)
        return cls(1.0 / g, q0, g.clone(), learn_u=False, **kw)

    @classmethod
    def rotation(
        cls, q: torch.Tensor, norm_gain: torch.Tensor | None = None, new_gain: torch.Tensor | None = None, **kw
    ) -> ContentTransform:
        """A rotation of the latent. Without a norm: ``T = Q``. With a norm of gain ``g``: ``T = diag(g)^-1 Q
        diag(g')`` with ``g' = new_gain`` (default ones: the gain is folded into ``kv_b_proj``, as QuaRot does)."""
        dc = q.shape[0]
        if norm_gain is None:
            return cls(torch.ones(dc), q, torch.ones(dc), learn_u=kw.pop("learn_u", True), **kw)
        g = _check_gain(norm_gain)
        g2 = torch.ones(dc, dtype=torch.float64) if new_gain is None else new_gain.double()
        return cls(1.0 / g, q, g2, learn_u=False, **kw)

    @classmethod
    def diagonal(cls, d: torch.Tensor, norm_gain: torch.Tensor | None = None, **kw) -> ContentTransform:
        """``T = diag(d)`` (per-channel smoothing; with a norm of gain ``g`` the new gain is ``g * d``)."""
        dc = d.shape[0]
        eye = torch.eye(dc, dtype=torch.float64)
        if norm_gain is None:
            return cls(torch.ones(dc), eye, d.double(), learn_u=kw.pop("learn_u", True), **kw)
        g = _check_gain(norm_gain)
        return cls(1.0 / g, eye, g * d.double(), learn_u=False, **kw)


def _check_gain(g: torch.Tensor) -> torch.Tensor:
    g = g.detach().double().cpu()
    if bool((g.abs() < 1e-12).any()):
        raise ValueError(
            "kv_a_layernorm has a zero gain; T = diag(g)^-1 Q diag(g') is undefined. Such a channel is always zero "
            "in the cache -- prune it from the model before calibrating."
        )
    return g


# ---- RoPE ----------------------------------------------------------------------------------------------------


class RopeTransform(nn.Module):
    """Per frequency pair ``p`` a complex factor ``z_p = s_p e^{i phi_p}`` (scale-and-rotation, commutes with RoPE).

    Parameters ``log_s`` [Dr/2] and ``phi`` [Dr/2], starting at ``log_s0``/``phi0`` (zeros = identity). The key
    is multiplied by ``z`` (:meth:`key`), the query by ``z / |z|^2`` (:meth:`query`, the inverse-transpose), so
    ``query(q) . key(k) == q . k`` for every pair of vectors.
    """

    def __init__(
        self,
        num_pairs: int,
        log_s0: torch.Tensor | None = None,
        phi0: torch.Tensor | None = None,
        *,
        learn_scale: bool = True,
        learn_angle: bool = True,
    ) -> None:
        super().__init__()
        z = torch.zeros(num_pairs, dtype=torch.float32)
        self.log_s = nn.Parameter(z.clone() if log_s0 is None else log_s0.detach().float().clone(), learn_scale)
        self.phi = nn.Parameter(z.clone() if phi0 is None else phi0.detach().float().clone(), learn_angle)

    @property
    def num_pairs(self) -> int:
        return self.log_s.shape[0]

    def _factor(self, dtype: torch.dtype, power: float) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.exp(self.log_s.to(dtype) * power)
        phi = self.phi.to(dtype)
        return s * torch.cos(phi), s * torch.sin(phi)

    def key(self, k: torch.Tensor, pairing: str) -> torch.Tensor:
        """``k z`` for ``k`` [..., Dr] with the given pair layout."""
        re, im = self._factor(k.dtype, 1.0)
        return complex_pair_mul(k, re, im, pairing)

    def key_inverse(self, kz: torch.Tensor, pairing: str) -> torch.Tensor:
        """``kz / z``."""
        s = torch.exp(-self.log_s.to(kz.dtype))
        phi = self.phi.to(kz.dtype)
        return complex_pair_mul(kz, s * torch.cos(phi), -s * torch.sin(phi), pairing)

    def query(self, q: torch.Tensor, pairing: str) -> torch.Tensor:
        """``q z / |z|^2`` (the inverse-transpose of the key's 2x2 map)."""
        re, im = self._factor(q.dtype, -1.0)
        return complex_pair_mul(q, re, im, pairing)

    def learnable(self) -> RopeTransform:
        """A fresh, fully learnable copy starting at this transform's current value."""
        return RopeTransform(self.num_pairs, self.log_s.detach().clone(), self.phi.detach().clone())

    @classmethod
    def identity(cls, num_pairs: int, **kw) -> RopeTransform:
        return cls(num_pairs, **kw)

    @classmethod
    def random_rotation(cls, num_pairs: int, seed: int = 0, **kw) -> RopeTransform:
        """Unit-scale rotations by seeded uniform angles (QuaRot-MLA's RoPE path)."""
        gen = torch.Generator().manual_seed(seed)
        phi = torch.rand(num_pairs, generator=gen, dtype=torch.float64) * 2 * math.pi
        return cls(num_pairs, None, phi, **kw)

    @classmethod
    def scales(cls, s: torch.Tensor, **kw) -> RopeTransform:
        """Pure per-pair scales ``s`` [Dr/2] (SmoothQuant-MLA's RoPE path)."""
        return cls(s.shape[0], torch.log(s.double()), None, **kw)
