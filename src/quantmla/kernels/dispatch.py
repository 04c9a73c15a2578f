"""Choosing between the CUDA, Triton and torch implementations, and the public attention entry points.

``impl="auto"`` for decode attention on a CUDA device picks the CUDA C++ kernel (``kernels/csrc``, built with
nvcc on first use) when the GPU is sm_80 or newer and the cache's format/shape is one it handles, else Triton
when it handles them, else torch; on the CPU it is torch. If the CUDA kernel cannot be built (no nvcc), auto
says so once (a warning) and uses Triton. Writes use Triton on CUDA. Overrides, strongest first: an explicit
``impl="torch"``, ``"triton"`` or ``"cuda"`` argument; :func:`force_impl` (a context manager for tests); the
environment variable ``QUANTMLA_KERNEL_IMPL`` (``auto``, ``torch``, ``triton`` or ``cuda``). Asking for an
implementation where it cannot run raises an error that says why instead of silently falling back.

Nothing here imports Triton at module import time.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

from quantmla.kernels.layout import content_pack_group
from quantmla.quant.formats import CacheFormat

IMPLS = ("auto", "torch", "triton", "cuda")
ENV_VAR = "QUANTMLA_KERNEL_IMPL"
_forced: list[str] = []


@contextlib.contextmanager
def force_impl(impl: str) -> Iterator[None]:
    """Within the block, every ``impl="auto"`` call resolves to ``impl``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _forced.append(impl)
    try:
        yield
    finally:
        _forced.pop()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_unsupported_reason(fmt: CacheFormat, kv_lora_rank: int, rope_dim: int, page_size: int, kernel: str) -> str:
    """Empty string when the Triton ``kernel`` ("write" or "decode") handles this format and shape, else why not."""
    for label, s in (("content", fmt.content), ("rope", fmt.rope)):
        if s is not None and s.scale_dtype != "fp16":
            return f"{label} scales must be fp16 for the paged layout"
    if kernel == "write":
        return ""
    c, r = fmt.content, fmt.rope
    if (c is None) != (r is None):
        return "the decode kernel needs both paths quantized or both BF16"
    if not _pow2(page_size) or not 16 <= page_size <= 256:
        return f"page_size must be a power of two in [16, 256], got {page_size}"
    sub = kv_lora_rank // 4
    if kv_lora_rank % 4 or not _pow2(sub) or sub < 16:
        return f"kv_lora_rank/4 must be a power of two >= 16, got kv_lora_rank={kv_lora_rank}"
    if not _pow2(rope_dim) or rope_dim < 16:
        return f"rope_dim must be a power of two >= 16, got {rope_dim}"
    if c is None:
        return ""
    if c.bits not in (2, 4, 8) or r.bits not in (4, 8):
        return f"content bits must be 2, 4 or 8 and RoPE bits 4 or 8 (got C{c.bits}R{r.bits})"
    if c.group_size % sub:
        return f"content group_size {c.group_size} must be a multiple of kv_lora_rank/4 = {sub}"
    pg = content_pack_group(c)  # where the codes sit (the scale group above says which meta row scales them)
    two_planes = c.bits == 2 and pg == 2 * sub  # a sub-tile = two planes of a group (latent 256, C2R4)
    if c.bits < 8 and pg != sub and pg * c.bits // 8 < sub and not two_planes:
        return (f"content packing group {pg} must be kv_lora_rank/4 = {sub}, "
                f"{'2 x that or ' if c.bits == 2 else ''}at least {sub * 8 // c.bits}")
    if c.bits < 8 and (pg == sub or two_planes) and page_size < 64:
        # the grouped-planar sub-tiles (one group per sub-tile) gave wrong results on the H200 (Triton 3.6) with
        # 16-token tiles while the interpreter and 64-token tiles are right; unverified there, so not offered
        return f"grouped {c.bits}-bit content needs pages of at least 64 tokens in the Triton decode kernel"
    hr = rope_dim // 2  # the kernel reads RoPE in two halves (4 bit: the two planes), each inside one group
    if r.group_size % hr or hr < 16:
        return f"RoPE group_size {r.group_size} must be a multiple of rope_dim / 2 = {hr} (>= 16)"
    return ""


_CUDA_OK: dict[str, bool] = {}


def cuda_kernel_available(device: torch.device, kernel: str = "mma") -> bool:
    """True when the CUDA decode kernel ``kernel`` (``"mma"`` or ``"wgmma"``) can run on ``device`` (sm_80+, and
    it builds); a build failure is reported once as a warning and remembered."""
    if device.type != "cuda":
        return False
    key = f"{device}/{kernel}"
    if key not in _CUDA_OK:
        from quantmla.kernels.cuda_build import CudaBuildError, load
        from quantmla.kernels.cuda_decode import kernel_source

        ok = torch.cuda.get_device_capability(device)[0] >= 8
        if ok:
            try:
                name, arch = kernel_source(kernel)
                load(name, device, arch)
            except CudaBuildError as e:
                warnings.warn(f"quantmla: CUDA decode kernel {kernel!r} unavailable, using Triton ({e})", stacklevel=3)
                ok = False
        _CUDA_OK[key] = ok
    return _CUDA_OK[key]


def resolve_impl(impl: str, x: torch.Tensor, fmt: CacheFormat, *, kernel: str, layout=None, cache=None) -> str:
    """``"torch"``, ``"triton"`` or ``"cuda"`` for a call on tensor ``x`` with format ``fmt`` (``cache``: the
    decode cache, needed to consider the CUDA kernel)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if _forced:
            impl = _forced[-1]
        else:
            env = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
            if env not in IMPLS:
                raise ValueError(f"{ENV_VAR}={env!r} is not one of {IMPLS}")
            impl = env
    dims = (512, 64, 64) if layout is None else (layout.kv_lora_rank, layout.rope_dim, layout.page_size)
    reason = triton_unsupported_reason(fmt, *dims, kernel=kernel)
    on_gpu = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "cuda":
        if kernel != "decode" or cache is None:
            raise ValueError(f"impl='cuda' exists for decode attention only, not for {kernel}")
        from quantmla.kernels.cuda_decode import cuda_kernel_choice, cuda_unsupported_reason

        kern = cuda_kernel_choice(x.device, cache=cache, heads=x.shape[1]) if x.is_cuda else "mma"
        why = cuda_unsupported_reason(cache, kern)
        if why:
            raise ValueError(f"impl='cuda' cannot run decode for format {fmt.name!r}: {why}")
        if not x.is_cuda:
            raise RuntimeError("impl='cuda' needs CUDA tensors")
        return "cuda"
    if impl == "auto":
        if x.is_cuda and kernel == "decode" and cache is not None and triton_available():
            from quantmla.kernels.cuda_decode import bf16_pages_on_cuda, cuda_kernel_choice, cuda_unsupported_reason

            # BF16 pages take the wgmma kernel only where the work is small (measured ahead of Triton there, behind
            # above: cuda_decode.BF16_WGMMA_MAX_WORK)
            kern = cuda_kernel_choice(x.device, cache=cache, heads=x.shape[1])
            bf16 = cache.fmt.content is None and cache.fmt.rope is None
            wanted = not bf16 or bf16_pages_on_cuda(x.device, cache, x.shape[1])
            if wanted and not cuda_unsupported_reason(cache, kern) and cuda_kernel_available(x.device, kern):
                return "cuda"
        return "triton" if x.is_cuda and not reason and triton_available() else "torch"
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' but triton is not installed (pip install triton)")
        if reason:
            raise ValueError(f"impl='triton' cannot run {kernel} for format {fmt.name!r}: {reason}")
        if not on_gpu:
            raise RuntimeError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
    return impl


def _rope_query(cache, q_pe: torch.Tensor) -> torch.Tensor:
    """``q_pe`` as it reads ``cache``'s keys (:meth:`PagedMLACache.rope_query`: rotated where the cache's rounding
    plan has a post-RoPE rotation; a cache-like object without the method stores keys unrotated)."""
    f = getattr(cache, "rope_query", None)
    return q_pe if f is None else f(q_pe)


def decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    *,
    impl: str = "auto",
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """Decode attention over a :class:`~quantmla.kernels.paged.PagedMLACache`.

    ``q_lat [B, H, Dc]`` (absorbed query, latent part), ``q_pe [B, H, Dr]`` (rotated RoPE part) ->
    ``o_lat [B, H, Dc]`` fp32 (and ``lse [B, H]`` natural log when ``return_lse``). ``num_splits``: split-K
    factor (default: a heuristic that fills the GPU). A cache whose rounding plan carries a post-RoPE rotation
    stores its keys rotated: ``q_pe`` is rotated here, for every kernel alike."""
    q_pe = _rope_query(cache, q_pe)
    which = resolve_impl(impl, q_lat, cache.fmt, kernel="decode", layout=cache.layout, cache=cache)
    if which == "cuda":
        from quantmla.kernels.cuda_decode import decode_attention_cuda

        return decode_attention_cuda(q_lat, q_pe, cache, softmax_scale, num_splits=num_splits, return_lse=return_lse)
    if which == "torch":
        from quantmla.kernels.reference import decode_attention_torch

        return decode_attention_torch(q_lat, q_pe, cache, softmax_scale, return_lse=return_lse)
    from quantmla.kernels.triton_decode import decode_attention_triton

    return decode_attention_triton(
        q_lat, q_pe, cache, softmax_scale, num_splits=num_splits, return_lse=return_lse
    )


def _prefill_impl(impl: str, x: torch.Tensor) -> str:
    """``impl`` of a prefill call with ``"auto"`` resolved: ``split`` on CUDA unless :func:`force_impl` or the
    environment ask for ``torch``."""
    if impl != "auto":
        return impl
    forced = _forced[-1] if _forced else (os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")
    return "split" if x.is_cuda and forced != "torch" else "torch"


def prefill_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    softmax_scale: float,
    n_new=None,
    *,
    recent: torch.Tensor | None = None,
    impl: str = "auto",
    **kw,
):
    """Chunked prefill over the paged cache, per-query policy: ``q_lat [B, H, T, Dc]`` -> ``[B, H, T, Dc]`` fp32
    (contract: :func:`quantmla.kernels.reference.prefill_attention_torch`). ``impl``: ``"torch"`` (the fp32
    reference), ``"split"`` (:func:`quantmla.kernels.prefill.prefill_attention_split`: a transient BF16 workspace,
    unmasked attention over the keys every query of a block reads packed and masked attention over the window band,
    merged by log-sum-exp; the GPU path), ``"sdpa"`` (:func:`quantmla.kernels.prefill.prefill_attention_sdpa`: the
    previous GPU path, torch's fused attention with the policy as one mask; kept for comparison) or ``"auto"``
    (``split`` on CUDA unless :func:`force_impl` or the environment ask for ``torch``). ``q_pe`` is rotated as
    :func:`decode_attention` rotates it."""
    impl = _prefill_impl(impl, q_lat)
    q_pe = _rope_query(cache, q_pe)
    if impl == "torch":
        from quantmla.kernels.reference import prefill_attention_torch

        return prefill_attention_torch(q_lat, q_pe, cache, softmax_scale, n_new, recent=recent, **kw)
    if impl == "split":
        from quantmla.kernels.prefill import prefill_attention_split

        return prefill_attention_split(q_lat, q_pe, cache, softmax_scale, n_new, recent=recent, **kw)
    if impl == "sdpa":
        from quantmla.kernels.prefill import prefill_attention_sdpa

        return prefill_attention_sdpa(q_lat, q_pe, cache, softmax_scale, n_new, recent=recent, **kw)
    raise ValueError(f"prefill impl must be 'auto', 'torch', 'split' or 'sdpa', got {impl!r}")


def prefill_attention_heads(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
    n_new=None,
    *,
    recent: torch.Tensor | None = None,
    impl: str = "auto",
    **kw,
):
    """Chunked prefill with per-head outputs: ``q_nope [B, H, T, Dn]``, ``q_pe [B, H, T, Dr]``, ``W_UK [H, Dn,
    Dc]``, ``W_UV [H, Dv, Dc]`` -> ``o [B, H, T, Dv]`` fp32 (contract:
    :func:`quantmla.kernels.reference.prefill_attention_heads_torch`, ``W_UV`` times the latent output).
    ``impl``: ``"torch"`` (the fp32 reference), ``"split"`` (:func:`quantmla.kernels.prefill.prefill_attention_heads`:
    keys and values up-projected per head, ~3.4x fewer multiply-adds than the latent form; the GPU path) or
    ``"auto"`` (``split`` on CUDA unless :func:`force_impl` or the environment ask for ``torch``). ``q_pe`` is
    rotated as :func:`decode_attention` rotates it."""
    impl = _prefill_impl(impl, q_nope)
    q_pe = _rope_query(cache, q_pe)
    if impl == "torch":
        from quantmla.kernels.reference import prefill_attention_heads_torch

        return prefill_attention_heads_torch(q_nope, q_pe, cache, w_uk, w_uv, softmax_scale, n_new, recent=recent,
                                             **kw)  # fmt: skip
    if impl == "split":
        from quantmla.kernels.prefill import prefill_attention_heads as heads

        return heads(q_nope, q_pe, cache, w_uk, w_uv, softmax_scale, n_new, recent=recent, **kw)
    raise ValueError(f"per-head prefill impl must be 'auto', 'torch' or 'split', got {impl!r}")
