"""The dual-path MLA cache of one attention layer, in pure torch (the reference the kernels match).

Per token the layer stores a packed low-bit copy of the content latent ``c_kv`` [Dc] and of the rotated
RoPE key ``k_pe`` [Dr], each in its own :class:`~quantmla.quant.spec.QuantSpec` (the cache format).
The mixed-precision policy keeps, in addition, full-precision copies of the first ``sink`` tokens and
of the last ``local`` tokens (a ring buffer indexed by ``position % local``). Every incoming token is
quantized exactly once, when it is written; when it leaves the local window attention simply switches
to its packed copy.

Which copy attention reads (the *policy*): for a query at position ``t`` and a cached token ``j``,
token ``j`` is read in full precision iff ``j < sink`` or ``j > t - local``, else from its packed copy.
This is per query, so a prefill chunk sees exactly what token-by-token decoding would have seen, and
one softmax covers all valid tokens. ``read()`` returns the reconstruction as seen by the newest token
(the view transformers' own attention gets through ``Cache.update``).

With the BF16 format nothing is quantized: the layer is a plain growing latent cache.
"""

from __future__ import annotations

import torch

from quantmla.quant.formats import CacheFormat, CachePolicy
from quantmla.quant.packing import pack, unpack
from quantmla.quant.quantize import dequantize_codes, quantize_codes
from quantmla.quant.spec import QuantSpec


class _Growing:
    """A [B, S, ...] tensor that grows along S by appends, with capacity doubling (amortized O(1) per token).

    ``nbytes()`` counts the tokens held (the cache's size), not the spare capacity."""

    def __init__(self, batch: int, tail: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.buf = torch.empty(batch, 16, *tail, dtype=dtype, device=device)
        self.n = 0

    @property
    def data(self) -> torch.Tensor:
        return self.buf[:, : self.n]

    def append(self, x: torch.Tensor) -> None:
        need = self.n + x.shape[1]
        if need > self.buf.shape[1]:
            cap = max(need, 2 * self.buf.shape[1])
            new = torch.empty(self.buf.shape[0], cap, *self.buf.shape[2:], dtype=self.buf.dtype, device=self.buf.device)
            new[:, : self.n] = self.buf[:, : self.n]
            self.buf = new
        self.buf[:, self.n : need] = x
        self.n = need

    def select(self, index: torch.Tensor) -> None:
        self.buf = self.buf[index]

    def nbytes(self) -> int:
        return self.data.nbytes


class _PackedPath:
    """Packed storage of one path: codes [B, S, D*b/8] uint8, scale/offset [B, S, G], plus an fp32 working copy
    of the dequantized values [B, S, D] that the torch reference attends over (scratch: a kernel reads the
    packed codes instead; not counted as cache memory)."""

    def __init__(self, spec: QuantSpec, width: int, batch: int, device: torch.device):
        spec.check_width(width)
        self.spec, self.width = spec, width
        g = spec.num_groups(width)
        sd = spec.torch_scale_dtype
        self.codes = _Growing(batch, (spec.code_bytes(width),), torch.uint8, device)
        self.scale = _Growing(batch, (g,), sd, device)
        self.offset = None if spec.symmetric else _Growing(batch, (g,), sd, device)
        self.deq = _Growing(batch, (width,), torch.float32, device)

    def append(self, x: torch.Tensor) -> None:  # x: [B, T, D]
        codes, scale, offset = quantize_codes(x, self.spec)
        self.codes.append(pack(codes, self.spec.bits))
        self.scale.append(scale)
        if offset is not None:
            self.offset.append(offset)
        self.deq.append(dequantize_codes(codes, scale, offset, self.spec))

    def dequantize(self) -> torch.Tensor:  # -> fp32 [B, S, D], from the packed codes
        codes = unpack(self.codes.data, self.spec.bits, self.width)
        off = None if self.offset is None else self.offset.data
        return dequantize_codes(codes, self.scale.data, off, self.spec)

    def select(self, index: torch.Tensor) -> None:
        for g in (self.codes, self.scale, self.offset, self.deq):
            if g is not None:
                g.select(index)

    def nbytes(self) -> int:
        return self.codes.nbytes() + self.scale.nbytes() + (0 if self.offset is None else self.offset.nbytes())


class DualPathLayer:
    """One layer's dual-path cache (implements :class:`quantmla.cache.protocol.MLACacheLayer`)."""

    def __init__(self, fmt: CacheFormat, policy: CachePolicy | None = None):
        self.fmt = fmt
        self.policy = policy or CachePolicy()
        self.length = 0
        self.batch: int | None = None
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None
        self.dtype: torch.dtype | None = None

    # -- storage -----------------------------------------------------------------------------------
    def _init(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        b, _, dc = c_kv.shape
        dr = k_pe.shape[-1]
        self.fmt = self.fmt.adapted(dc, dr)
        self.fmt.check_dims(dc, dr)
        self.batch, self.dc, self.dr = b, dc, dr
        self.dtype, self.device = c_kv.dtype, c_kv.device
        grow = lambda w: _Growing(b, (w,), c_kv.dtype, c_kv.device)  # noqa: E731
        # Full-precision tensors of a path that is not quantized (BF16 format or e.g. C4R16).
        self.full_c = grow(dc) if self.fmt.content is None else None
        self.full_r = grow(dr) if self.fmt.rope is None else None
        self.packed_c = None if self.fmt.content is None else _PackedPath(self.fmt.content, dc, b, c_kv.device)
        self.packed_r = None if self.fmt.rope is None else _PackedPath(self.fmt.rope, dr, b, c_kv.device)
        p = self.policy
        if self.fmt.is_quantized:
            self.sink_buf = torch.zeros(b, p.sink, dc + dr, dtype=c_kv.dtype, device=c_kv.device)
            self.local_buf = torch.zeros(b, p.local, dc + dr, dtype=c_kv.dtype, device=c_kv.device)

    def _check(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        if c_kv.dim() != 3 or k_pe.dim() != 3:
            raise ValueError(
                f"write expects c_kv [B, T, Dc] and k_pe [B, T, Dr], got shapes {tuple(c_kv.shape)} and "
                f"{tuple(k_pe.shape)}"
            )
        if c_kv.shape[:2] != k_pe.shape[:2]:
            raise ValueError(f"c_kv {tuple(c_kv.shape)} and k_pe {tuple(k_pe.shape)} disagree on [B, T]")
        if not (torch.is_floating_point(c_kv) and torch.is_floating_point(k_pe)):
            raise TypeError(f"c_kv and k_pe must be floating point, got {c_kv.dtype} and {k_pe.dtype}")
        if c_kv.dtype != k_pe.dtype:
            raise TypeError(f"c_kv ({c_kv.dtype}) and k_pe ({k_pe.dtype}) must share a dtype")
        if self.batch is not None:
            if c_kv.shape[0] != self.batch:
                raise ValueError(f"cache holds batch {self.batch} but got a write of batch {c_kv.shape[0]}")
            if (c_kv.shape[-1], k_pe.shape[-1]) != (self.dc, self.dr):
                raise ValueError(
                    f"cache holds widths (content {self.dc}, rope {self.dr}) but got "
                    f"({c_kv.shape[-1]}, {k_pe.shape[-1]})"
                )
            if c_kv.dtype != self.dtype:
                raise TypeError(f"cache holds {self.dtype} but got {c_kv.dtype}")

    def write(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append T tokens: ``c_kv`` [B, T, Dc] and ``k_pe`` [B, T, Dr] (after RoPE)."""
        self._check(c_kv, k_pe)
        if self.batch is None:
            self._init(c_kv, k_pe)
        t = c_kv.shape[1]
        if t == 0:
            return
        s0 = self.length
        (self.full_c or self.packed_c).append(c_kv)
        (self.full_r or self.packed_r).append(k_pe)
        if self.fmt.is_quantized:
            both = torch.cat([c_kv, k_pe], dim=-1)  # [B, T, Dc + Dr]
            # Full-precision values this step's queries may read: the buffers as they were before this
            # write, plus the T new tokens (not cache memory: they are the step's own activations).
            old_pos, old_vals = self.protected()
            self.fresh = (
                torch.cat([old_pos, torch.arange(s0, s0 + t, device=c_kv.device)]),
                torch.cat([old_vals, both], dim=1),
            )
            p = self.policy
            n_sink = max(0, min(p.sink - s0, t))
            if n_sink:
                self.sink_buf[:, s0 : s0 + n_sink] = both[:, :n_sink]
            if p.local:
                first = max(s0, s0 + t - p.local)
                pos = torch.arange(first, s0 + t, device=c_kv.device)
                self.local_buf[:, pos % p.local] = both[:, first - s0 :]
        self.length += t

    # -- reading -----------------------------------------------------------------------------------
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token from its packed copy (full-precision paths as stored): fp32 [B, S, Dc], [B, S, Dr].

        Read-only views of the working copies (equal, bit for bit, to unpacking and dequantizing the codes)."""
        c = self.full_c.data.float() if self.full_c is not None else self.packed_c.deq.data
        r = self.full_r.data.float() if self.full_r is not None else self.packed_r.deq.data
        return c, r

    def protected(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [P] and full-precision values [B, P, Dc + Dr] of every token still held in the buffers."""
        p, s = self.policy, self.length
        n_sink = min(p.sink, s)
        lo = max(n_sink, s - p.local)
        ring = torch.arange(lo, s, device=self.device)
        pos = torch.cat([torch.arange(n_sink, device=self.device), ring])
        vals = torch.cat([self.sink_buf[:, :n_sink], self.local_buf[:, ring % max(p.local, 1)]], dim=1)
        return pos, vals

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as the newest token sees it: [B, S, Dc], [B, S, Dr] in the incoming dtype."""
        c, r = (t.clone() for t in self.dequantized())
        if self.fmt.is_quantized and self.length:
            pos, vals = self.protected()
            c[:, pos] = vals[..., : self.dc].float()
            r[:, pos] = vals[..., self.dc :].float()
        return c.to(self.dtype), r.to(self.dtype)

    def attend(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Absorbed attention of the T newest tokens' queries over the whole cache, per-query policy.

        q_lat [B, H, T, Dc], q_pe [B, H, T, Dr]; mask None (causal) or bool broadcastable to [B, H, T, S].
        Returns o_lat [B, H, T, Dc] in fp32. Reference implementation (fp32 torch).
        """
        from quantmla.cache.reference import mixed_policy_attention

        return mixed_policy_attention(self, q_lat, q_pe, scale, mask)

    def get_seq_length(self) -> int:
        return self.length

    # -- bookkeeping -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes actually allocated by this layer's tensors."""
        if self.batch is None:
            return 0
        n = 0
        for g in (self.full_c, self.full_r, self.packed_c, self.packed_r):
            n += 0 if g is None else g.nbytes()
        if self.fmt.is_quantized:
            n += self.sink_buf.nbytes + self.local_buf.nbytes
        return n

    def select_batch(self, index: torch.Tensor) -> None:
        if self.batch is None:
            return
        for name in ("sink_buf", "local_buf"):
            t = getattr(self, name, None)
            if t is not None:
                setattr(self, name, t[index])
        for g in (self.full_c, self.full_r, self.packed_c, self.packed_r):
            if g is not None:
                g.select(index)
        self.batch = int(index.numel()) if index.dtype != torch.bool else int(index.sum())
