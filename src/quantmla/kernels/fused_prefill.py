"""Torch's fused attention with its log-sum-exp, as the building blocks of the per-head prefill on CUDA.

:func:`attention` runs one part of a query block's keys in torch's memory-efficient SDPA kernel (no score tile is
materialized; it returns the log-sum-exp, so parts merge exactly in :class:`quantmla.kernels.prefill._Softmax`):
unmasked, causal (as many keys as queries, key ``k`` admitted by query ``i`` iff ``k <= i``: top-left and
bottom-right alignment agree) or with an additive mask (:func:`near_bias`). On the CPU, or where torch has no such
kernel, it returns None and the caller runs score tiles.

:func:`block_parts` splits the keys of a query block ``[q0, q1)`` (``t`` positions) under the per-query policy
(sink ``s``, local window ``L``: a query at ``q`` reads the BF16 copy of ``j < s`` or ``q - L < j <= q`` and the
packed copy of ``s <= j <= q - L``) into parts whose masks are free or cheap, once the block starts at
``q0 >= s + L``:

* **far**: packed ``[s, q0 - L)`` -- every query reads all of them: unmasked, in chunks;
* **triangle**: packed ``[q0 - L, q1 - L)`` -- query ``q0 + i`` reads key ``q0 - L + k`` iff ``k <= i``: causal,
  ``t`` keys for ``t`` queries (half the work of the rectangle, and no mask to read);
* **band**: the BF16 copies of ``(q0 - L, q1)``, query ``q`` reads ``(q - L, q]``: a band of width ``L``, run as
  ``ceil(t / BAND_BLOCK)`` sub-blocks of ``u = BAND_BLOCK`` queries over their ``u + L - 1`` keys (plus the ``s``
  sink copies, which every query reads), batched into one masked call whose mask ``[u, s + u + L - 1]`` is the
  same for every sub-block.

So a block costs ``t (q0 - L) + t^2 / 2 + t (s + u + L)`` scores instead of the masked band's ``t (q0 - L + 1) + 2 t
(t + L)`` (DeepSeek's policy, 8192-query blocks: the near part ~3.5x less work). A BF16 cache is the policy
``s = L = 0``: far ``[0, q0)`` and the causal triangle of the block itself. Blocks that start before ``s + L``
(a prompt's first ``s + L`` positions) keep the masked band (:mod:`quantmla.kernels.prefill`).
"""

from __future__ import annotations

import warnings
from bisect import bisect_left

import torch
import torch.nn.functional as F

MASKED = -30000.0  # the additive mask: finite, so a row with no admitted key gets a finite log-sum-exp ~-30000
# that merges with weight exp(-30000 - m) = 0 (with -inf a kernel may return NaN for it)
BAND_BLOCK = 256  # queries per sub-block of the BF16 band (scores t (s + BAND_BLOCK + L - 1))
_FUSED: dict[str, bool] = {}  # per device + kind (":masked", ":causal"): whether the fused kernel ran there


def near_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` bool ``[t, S]`` -> the additive mask ``[t, S]`` of the fused kernel: 0 where admitted, :data:`MASKED`
    elsewhere, in ``dtype``, its rows 16-element aligned (the memory-efficient kernel's requirement)."""
    t, S = allowed.shape
    bias = torch.zeros(t, -(-S // 16) * 16, dtype=dtype, device=allowed.device)[:, :S]
    return bias.masked_fill_(~allowed, MASKED)


def available(device: torch.device) -> bool:
    """Whether :func:`attention` may run there (CUDA, no kind of call refused yet)."""
    return device.type == "cuda" and not any(v is False for k, v in _FUSED.items() if k.startswith(str(device)))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor | None = None,
              causal: bool = False):  # fmt: skip
    """Attention of ``q [..., G, M, D]`` over ``k [..., G, S, D]``, ``v [..., G, S, Dv]`` (at most one leading batch
    dim) in one fused kernel -> ``(o [..., G, M, Dv] fp32, lse [..., G, M, 1])``, or None where there is none (the
    CPU; a torch without it: warned once per kind, then the caller's tiles). ``allowed``: bool ``[M, S]``, the keys
    each query row admits, the same for every batch and g; ``causal``: key ``k`` admitted by row ``i`` iff ``k <=
    i`` (needs ``M == S``)."""
    kind = ":masked" if allowed is not None else ":causal" if causal else ""
    key = str(q.device) + kind
    if not q.is_cuda or _FUSED.get(key) is False:
        return None
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"a causal part needs as many keys as queries, got {q.shape[-2]} and {k.shape[-2]}")
    one = q.dim() == 3
    q, k, v = (x[None] if one else x for x in (q, k, v))  # [Bt, G, M, D]
    Bt, G, M, S, dv = q.shape[0], q.shape[1], q.shape[2], k.shape[2], v.shape[-1]
    b4 = None if allowed is None else near_bias(allowed, q.dtype)[None, None].expand(Bt, G, M, S)
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    try:
        o, lse = _run(q, k, v, b4, causal, scale, key)
    except _ERRORS as e:
        warnings.warn(f"quantmla: fused prefill attention ({key}) unavailable, using score tiles ({e})", stacklevel=2)
        _FUSED[key] = False
        return None
    _FUSED[key] = True
    o, lse = o[..., :dv].float(), lse[..., None].float()  # _run returns M log-sum-exp rows
    return (o[0], lse[0]) if one else (o, lse)


_ERRORS = (RuntimeError, TypeError, NotImplementedError, AttributeError, ValueError)
_CUDNN: dict[str, bool] = {}  # per device + kind: cuDNN's attention agreed with the memory-efficient kernel on its
# first call there (True), or failed or disagreed (False: the memory-efficient kernel from then on)


def _memory_efficient(q, k, v, bias, causal: bool, scale: float):
    """torch's memory-efficient kernel (sm80 code: any width, fp32, an additive bias) -> (o, lse [Bt, G, M])."""
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
    return o, lse[..., : q.shape[2]]  # it pads its log-sum-exp rows


def _cudnn(q, k, v, causal: bool, scale: float):
    """cuDNN's fused attention (Hopper code, ~2.6x the memory-efficient kernel's speed on the H200 for the same
    work: transformers' own prefill vs ours, ``step_profile_h200_v2lite_prefill.md``) -> (o, lse [Bt, G, M])."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                scale=scale)[:2]  # fmt: skip
    return o, lse.reshape(q.shape[:3])


def _run(q, k, v, bias, causal: bool, scale: float, key: str):
    """One fused call ``q [Bt, G, M, D]`` -> ``(o [Bt, G, M, Dv'], lse [Bt, G, M])``: cuDNN for BF16/FP16 parts with no
    bias, checked once per device and kind against the memory-efficient kernel on that very call (output within
    BF16 rounding, log-sum-exp within 1e-2: a different convention -- log2, unscaled -- or a mishandled stride
    fails it and cuDNN is not used there again, with a warning); the memory-efficient kernel otherwise."""
    if bias is not None or q.dtype not in (torch.bfloat16, torch.float16) or _CUDNN.get(key) is False:
        return _memory_efficient(q, k, v, bias, causal, scale)
    try:
        o, lse = _cudnn(q, k, v, causal, scale)
    except _ERRORS as e:
        warnings.warn(f"quantmla: cuDNN attention ({key}) unavailable, using the memory-efficient kernel ({e})",
                      stacklevel=3)  # fmt: skip
        _CUDNN[key] = False
        return _memory_efficient(q, k, v, bias, causal, scale)
    if key not in _CUDNN:
        om, lm = _memory_efficient(q, k, v, bias, causal, scale)
        err = ((o.float() - om.float()).norm() / om.float().norm().clamp_min(1e-30)).item()
        lerr = (lse.float() - lm.float()).abs().max().item() if lse.numel() else 0.0
        _CUDNN[key] = bool(err <= 2e-2 and lerr <= 1e-2)
        if not _CUDNN[key]:
            warnings.warn(f"quantmla: cuDNN attention ({key}) disagrees with the memory-efficient kernel (output "
                          f"rel. error {err:.1e}, log-sum-exp {lerr:.1e}); using the memory-efficient kernel",
                          stacklevel=3)  # fmt: skip
            return om, lm
    return o, lse


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """``x [..., S, D]`` as the memory-efficient kernel reads it safely: unit last stride, ``D`` padded with zeros
    to a multiple of 8 (zero query/key channels leave every score unchanged; zero value channels are sliced off the
    output), every other stride a multiple of 8 and a 16-byte aligned start. The kernel picks its vectorized
    variant from the widths and strides alone, so a slice of rows starting at an odd offset of a 20-wide tensor was
    read misaligned (a CUDA fault, H200 2026-12-01, on the tiny test model's ``v_head_dim = 20``); DeepSeek
    widths pass through uncopied."""
    pad = -x.shape[-1] % 8
    if pad == 0 and x.stride(-1) == 1 and all(st % 8 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 16 == 0:
        return x
    return F.pad(x, (0, pad)) if pad else x.clone(memory_format=torch.contiguous_format)  # fresh: aligned


def block_parts(ops, q: torch.Tensor, full: torch.Tensor, fpos: list[int], sink: int, local: int, q0: int, q1: int,
                scale: float) -> list[tuple[torch.Tensor, torch.Tensor]] | None:  # fmt: skip
    """The parts ``(o [G, t, Dv], lse [G, t, 1])`` of query block ``[q0, q1)`` (module docstring), or None where the
    split does not apply (``q0 < sink + local``, a BF16 copy of the band missing) or a fused kernel is not there.
    ``ops``: the per-head operands (``far(k0, k1)``: up-projected packed rows, ``rows(x)``: of BF16 rows x,
    ``fused_keys``: far keys per call); ``q [G, t, D]``; ``full [F, Dc + Dr]``: the BF16 copies at the sorted
    positions ``fpos``."""
    s, L, t = sink, local, q1 - q0
    a = q0 - L  # the triangle's first packed key
    if a < s or not available(q.device) or len(fpos) < s:
        return None
    f0 = bisect_left(fpos, a + 1)  # the band's BF16 copies: positions a + 1 ... q1 - 1, all of them
    if L and (len(fpos) < f0 + t + L - 1 or fpos[f0] != a + 1 or fpos[f0 + t + L - 2] != q1 - 1):
        return None
    if s and fpos[s - 1] != s - 1:
        return None
    parts = []
    for k0 in range(s, a, ops.fused_keys):  # far
        parts.append(attention(q, *ops.far(k0, min(a, k0 + ops.fused_keys)), scale))
    parts.append(attention(q, *ops.far(a, a + t), scale, causal=True))  # triangle
    if L:
        parts.append(_band(ops, q, full[:s], full[f0 : f0 + t + L - 1], L, scale))
    return None if any(p is None for p in parts) else parts


def _band(ops, q: torch.Tensor, sink_rows: torch.Tensor, rows: torch.Tensor, L: int, scale: float):
    """The BF16 band of a block: ``rows [t + L - 1, Dc + Dr]`` the copies of positions ``q0 - L + 1 ... q1 - 1``,
    ``sink_rows [s, .]``; sub-block ``r`` (queries ``q0 + r u + i``) reads keys ``r u + k``, ``i <= k <= i + L - 1``
    of ``rows`` and every sink row -> ``(o [G, t, Dv], lse [G, t, 1])`` or None."""
    G, t = q.shape[0], q.shape[1]
    u = min(BAND_BLOCK, t)
    R, W, s = -(-t // u), u + L - 1, sink_rows.shape[0]
    k, v = ops.rows(rows)  # [G, t + L - 1, Dk], [G, t + L - 1, Dv]
    k, v = (F.pad(x, (0, 0, 0, R * u - t)) for x in (k, v))  # [G, R u + L - 1, .]: keys no real query admits
    idx = (torch.arange(R, device=q.device)[:, None] * u + torch.arange(W, device=q.device)).flatten()  # [R W]
    win = [x[:, idx].view(G, R, W, x.shape[-1]).transpose(0, 1) for x in (k, v)]  # [R, G, W, .]
    if s:
        ks, vs = ops.rows(sink_rows)  # [G, s, .]
        win = [torch.cat([y[None].expand(R, *y.shape), x], dim=2) for x, y in zip(win, (ks, vs))]  # [R, G, s + W, .]
    qb = F.pad(q, (0, 0, 0, R * u - t)).view(G, R, u, q.shape[-1]).transpose(0, 1)  # [R, G, u, D]
    i, kk = torch.arange(u, device=q.device)[:, None], torch.arange(W, device=q.device)[None, :]
    allowed = torch.cat([torch.ones(u, s, dtype=torch.bool, device=q.device), (kk >= i) & (kk <= i + L - 1)], dim=1)
    out = attention(qb, win[0], win[1], scale, allowed)
    if out is None:
        return None
    o, lse = (x.transpose(0, 1).reshape(G, R * u, x.shape[-1])[:, :t] for x in out)  # [G, t, .]
    return o, lse
