"""Host side of the CUDA C++ packed-page decode kernels: checks, launch, finish.

Kernels with one contract and partial-output layout (one CTA per head group x split x sequence; see each
source's header for its design): ``"mma"`` (``csrc/decode_mla.cu``, mma.sync, 16 heads per CTA, sm_80+), ``"wgmma"``
(``csrc/decode_mla_sm90.cu``, Hopper warpgroup products with tokens on M, 16 heads per CTA) and ``"ws"``
(``csrc/decode_mla_sm90_ws.cu``, warp-specialized, 32 heads on N per CTA, C4R4 / C2R4 only; auto's choice at 17-32
heads); the last two are built for sm_90a, so H100 / H200 only. A fourth, ``"hm"`` (``csrc/decode_mla_sm90_hm.cu``,
64 heads on M, each page dequantized once per CTA by a producer warpgroup into fp16 values, C4R4 / C2R4, sm_90a), is
auto's choice for C4R4 / C2R4 from 33 heads on (session 37; docs/kernels.md "Many heads on M with a producer
warpgroup"). (``wgmma64`` -- 64 heads on M with exact codes, no producer -- was removed on 2026-12-02: another kernel
beat it at every format and head count measured.)
``$QUANTMLA_CUDA_KERNEL`` (a kernel's name or ``auto``) or the ``kernel`` argument chooses; the default ``auto`` is
the measured choice of :func:`cuda_kernel_choice` (mma off sm_90). The BF16 sink/local buffers run the Triton kernel
of :mod:`quantmla.kernels.triton_decode` on a side stream and a CUDA kernel merges the splits, so the result has the
contract of :func:`quantmla.kernels.reference.decode_attention_torch`.

Supported: DeepSeek shapes (latent 512 in content groups of 128, RoPE 64 in one group), pages of 64 tokens,
fp16 scales (asymmetric or symmetric), any number of heads, q in bf16 or fp32 (others are converted); content /
RoPE bits: C4R4 and C2R4 on every kernel, C8R8, C4R8 and BF16 pages on the wgmma kernel.
:func:`cuda_unsupported_reason` says why a cache is not.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os

import torch

from quantmla.kernels.split_plan import packed_page_counts, split_plan

LOG2E = 1.4426950408889634
HEADS_PER_CTA = 16
CTAS_PER_SM = {"mma": 3, "wgmma": 2, "ws": 1, "hm": 1}  # fallbacks if the occupancy query fails: mma 168
# registers, ~74 KB shared memory per CTA; wgmma 198-230 registers, 52-68 KB; ws 384 threads x 168 registers
# (setmaxnreg 216 / 144 / 144), ~155 KB; hm 384 x 168 (setmaxnreg 72 / 216 / 216), 227 KB
KERNELS = ("mma", "wgmma", "ws", "hm")
KERNEL_ENV = "QUANTMLA_CUDA_KERNEL"
DEFAULT_KERNEL = "auto"
# Auto on sm_90 at <= 16 heads takes wgmma for C4R4 / C2R4 at every size: measured ahead of the mma kernel from
# B1 x 128K to B64 x 128K (2^23 units of work), both kernels in one run (decode_vs_flashmla_h200_s31_large.md,
# 2026-12-05: C4R4 1.62-1.80x FlashMLA vs mma's 1.55-1.61x, C2R4 1.70-1.90x vs 1.57-1.63x). Until then mma took the
# grids past 2^21 units (session 11, when mma was 1.49x vs wgmma's 1.41x at B32 x 128K).
WGMMA_AUTO_MAX_HEADS = 16  # past 16 heads auto takes ws / hm (C4R4, C2R4) or the wgmma kernel's 16-head CTAs (C8R8,
# C4R8: 0.71-1.03x FlashMLA at 32 heads, 0.37-0.69x at 64, 0.25-0.39x at 128, where Triton gave 0.05-0.23x and the
# removed wgmma64 kernel 0.23-0.59x; decode_vs_flashmla_h200_s19_8bit_heads.md and _s19_heads.md, 2026-12-02)
BF16_WGMMA_MAX_WORK = 1 << 17  # auto on sm_90, BF16 pages: the wgmma kernel up to this many (sequence x 16-head
# group x token) units of work, Triton above (H200, decode_vs_flashmla_h200_s19_bf16.md, 2026-12-02, one run: wgmma
# 1.19x / 0.94x FlashMLA at B1 x 128K / B32 x 4K (2^17 units) where Triton gave 0.89x / 0.86x; Triton ahead from
# B8 x 32K (2^18) on, and at 32 heads and more)
WS_AUTO_BITS = ((4, 4), (2, 4))  # past 16 heads auto takes ws (hm from 33 on) for these: C4R4 1.18-1.28x the mma
# kernel at 32 / 64 / 128 heads, B32 x 32K and B8 x 128K (decode_vs_flashmla_h200_ws.md, 2026-12-01); C2R4 1.12x /
# 0.57x / 0.41x FlashMLA at 32 / 64 / 128 heads, B32 x 32K, vs mma's 0.91x / 0.46x / 0.32x, ahead or level at
# B8 x 128K and B1 x 128K too (decode_vs_flashmla_h200_ws2_s18.md, 2026-12-02)
HM_AUTO_MIN_HEADS = 33  # from 33 heads on auto takes hm for the formats in WS_AUTO_BITS (H100, 2026-12-06): C4R4
# 1.30-1.52x FlashMLA BF16 at 64 heads and 0.71-0.79x at 128 (B32 x 32K / B8 x 128K, kernel_variants_h100_hm_s37b.md),
# where ws gave 0.71-0.75x / 0.40-0.43x (decode_vs_flashmla_h100_hm_s37.md); C2R4 309-326 us at 64 heads, 575-633 at
# 128 (_s37c.md; ws 558-591 / 1077-1146). At 32 heads ws stays for now: side by side (H100, 2026-12-07,
# decode_vs_flashmla_h100_hm32_s42.md) hm is only 1-4% ahead for C4R4 and 5-7% for C2R4, and unmeasured there on the
# H200. 33-63 heads cost hm what 64 do, while ws runs two or more 32-head CTAs per page: hm from 33 on
_SOURCES = {
    "mma": ("decode_mla", None),
    "wgmma": ("decode_mla_sm90", "90a"),
    "ws": ("decode_mla_sm90_ws", "90a"),
    "hm": ("decode_mla_sm90_hm", "90a"),
}  # source, build arch


class _Params(ctypes.Structure):
    """Mirror of ``qmla::Params`` (checked against the library's ``sizeof`` on load)."""

    _fields_ = [
        ("q_lat", ctypes.c_void_p), ("q_pe", ctypes.c_void_p),
        ("q_lat_sb", ctypes.c_longlong), ("q_lat_sh", ctypes.c_longlong),
        ("q_pe_sb", ctypes.c_longlong), ("q_pe_sh", ctypes.c_longlong),
        ("pool", ctypes.c_void_p), ("page_bytes", ctypes.c_longlong),
        ("c_off", ctypes.c_int), ("r_off", ctypes.c_int), ("m_off", ctypes.c_int),
        ("c_srow", ctypes.c_int), ("c_orow", ctypes.c_int), ("r_srow", ctypes.c_int), ("r_orow", ctypes.c_int),
        ("block_table", ctypes.c_void_p), ("bt_stride", ctypes.c_longlong),
        ("lens", ctypes.c_void_p),
        ("po", ctypes.c_void_p), ("pl", ctypes.c_void_p),
        ("H", ctypes.c_int), ("ns_total", ctypes.c_int), ("pps", ctypes.c_int), ("sink", ctypes.c_int),
        ("local", ctypes.c_int),
        ("qk_scale", ctypes.c_float),
        ("q_fp32", ctypes.c_int),
        ("pdl_late", ctypes.c_int),
        ("c_groups", ctypes.c_int),
        ("arrivals", ctypes.c_void_p), ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
    ]  # fmt: skip


BITS = {"mma": ((4, 4), (2, 4)), "wgmma": ((4, 4), (2, 4), (8, 8), (4, 8), (16, 16))}  # (content, RoPE) bits built;
# 16/16: BF16 pages (both paths unquantized)
BITS["ws"] = ((4, 4), (2, 4))  # the warp-specialized many-heads kernel: 4/2-bit content, 4-bit RoPE
BITS["hm"] = ((4, 4), (2, 4))  # heads on M, pages dequantized once per 64 heads (auto from 33 heads on)


TOKEN_SCALE_KERNELS = ("wgmma",)  # the kernels built for one content scale per token (C4R4T, C2R4T)


def token_scale(fmt) -> bool:
    """Whether a format keeps one content scale per token (one quantization group spanning the latent: the T
    formats), which only the kernels in :data:`TOKEN_SCALE_KERNELS` are built for."""
    return fmt.content is not None and fmt.content.group_size == 512


def _bits(fmt) -> tuple[int, int]:
    """(content bits, RoPE bits) of a format; 16 for an unquantized path."""
    return (16 if fmt.content is None else fmt.content.bits, 16 if fmt.rope is None else fmt.rope.bits)


def cuda_unsupported_reason(cache, kernel: str = "mma") -> str:
    """Empty string when the CUDA kernel ``kernel`` handles this cache's format and shapes, else why not."""
    fmt, L = cache.fmt, cache.layout
    c, r = fmt.content, fmt.rope
    if (c is None) != (r is None):
        return "the CUDA kernels need both paths quantized or both BF16"
    if c is None and (16, 16) not in BITS[kernel]:
        return f"the {kernel} CUDA kernel has no BF16 pages (the Triton kernel runs them)"
    if L.kv_lora_rank != 512 or L.rope_dim != 64:
        return f"the CUDA kernel is built for latent 512 / RoPE 64, got {L.kv_lora_rank} / {L.rope_dim}"
    if L.page_size != 64:
        return f"the CUDA kernel needs pages of 64 tokens, got {L.page_size}"
    if c is None:
        return ""  # BF16 pages: no groups, scales or buffers
    if c.group_size not in (128, 512) or r.group_size != 64:
        return (f"content groups must be 128 (or 512, one per token) and RoPE one group of 64 (got {c.group_size} / "
                f"{r.group_size})")
    if token_scale(fmt):
        if kernel not in TOKEN_SCALE_KERNELS:
            return (f"one content scale per token ({fmt.name}) is built into the {'/'.join(TOKEN_SCALE_KERNELS)} "
                    f"kernel only (sm_90), not {kernel}")  # fmt: skip
        if (c.bits, r.bits) not in ((4, 4), (2, 4)) or c.symmetric or r.symmetric:
            return f"one content scale per token is built for asymmetric C4R4T / C2R4T, not {fmt.name}"
    if (c.bits, r.bits) not in BITS[kernel]:
        built = ", ".join("BF16" if a == 16 else f"C{a}R{b}" for a, b in BITS[kernel])
        return f"the {kernel} CUDA kernel is built for {built}, not C{c.bits}R{r.bits}"
    if c.scale_dtype != "fp16" or r.scale_dtype != "fp16":
        return "scales must be fp16"
    if cache.n_sink > 64:
        return f"sink must be at most 64 tokens, got {cache.n_sink}"
    return ""


def cuda_kernel_choice(device, kernel: str | None = None, *, cache=None, heads: int = HEADS_PER_CTA) -> str:
    """``"mma"``, ``"wgmma"``, ``"ws"`` or ``"hm"`` for ``device``: ``kernel`` if given, else
    ``$QUANTMLA_CUDA_KERNEL``, else the default ``"auto"``. Asking for a Hopper kernel off sm_90 is an error. ``auto``
    is mma off sm_90; on sm_90 it is wgmma up to :data:`WGMMA_AUTO_MAX_HEADS` heads (every format, every size:
    measured ahead of mma up to B64 x 128K) and past it, for the formats in :data:`WS_AUTO_BITS` (C4R4 and C2R4),
    ws up to 32 heads and hm from :data:`HM_AUTO_MIN_HEADS` (33) on, and wgmma for the other quantized ones (C8R8,
    C4R8). Whether BF16 pages take
    the CUDA kernel at all is :func:`bf16_pages_on_cuda`'s answer."""
    choice = (kernel or os.environ.get(KERNEL_ENV, "") or DEFAULT_KERNEL).strip().lower()
    if choice not in ("auto", *KERNELS):
        raise ValueError(f"CUDA decode kernel must be one of {('auto', *KERNELS)} (argument or ${KERNEL_ENV}), "
                         f"got {choice!r}")  # fmt: skip
    if choice == "mma":
        return choice
    cap = _capability(torch.device(device))
    if choice == "auto":
        if cap != (9, 0):
            return "mma"
        if cache is None:
            return "wgmma"
        if token_scale(cache.fmt):  # C4R4T / C2R4T: the one kernel built for them, at every head count
            return "wgmma"
        if heads > WGMMA_AUTO_MAX_HEADS and cache.fmt.is_quantized:
            if _bits(cache.fmt) not in WS_AUTO_BITS:
                return "wgmma"
            return "hm" if heads >= HM_AUTO_MIN_HEADS else "ws"
        return "wgmma"
    if cap != (9, 0):
        raise RuntimeError(f"the {choice} decode kernel is built for sm_90a (H100/H200); this GPU is "
                           f"sm_{cap[0]}{cap[1]}: use kernel='mma'")  # fmt: skip
    return choice


def bf16_pages_on_cuda(device, cache, heads: int) -> bool:
    """``auto`` for a BF16-page cache: the wgmma kernel (sm_90, with ``$QUANTMLA_CUDA_KERNEL`` unset or ``auto``) when
    the work -- sequences x 16-head groups x longest length -- is at most :data:`BF16_WGMMA_MAX_WORK`, else the Triton
    kernel (measured faster there)."""
    if (os.environ.get(KERNEL_ENV, "") or DEFAULT_KERNEL).strip().lower() != "auto":
        return False
    if _capability(torch.device(device)) != (9, 0):
        return False
    return _work(cache, heads) <= BF16_WGMMA_MAX_WORK


def _work(cache, heads: int) -> int:
    """The units of work auto's rules compare: sequences x 16-head groups x longest (planned) length."""
    return cache.batch * math.ceil(max(1, heads) / HEADS_PER_CTA) * cache.plan_longest()


@functools.lru_cache(maxsize=16)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (asked once per device)."""
    if device.type != "cuda":
        raise RuntimeError(f"the CUDA decode kernels need a CUDA device, got {device}")
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


def kernel_source(kernel: str) -> tuple[str, str | None]:
    """(source name, build architecture or None for the device's own) of a CUDA decode kernel."""
    return _SOURCES[kernel]


def _lib(device, kernel: str = "mma"):
    from quantmla.kernels.cuda_build import CudaBuildError, load

    name, arch = kernel_source(kernel)
    lib = load(name, device, arch)
    if not getattr(lib, "_qmla_checked", False):
        lib.qmla_params_size.restype = ctypes.c_int
        lib.qmla_decode.restype = ctypes.c_int
        lib.qmla_decode.argtypes = [ctypes.POINTER(_Params)] + [ctypes.c_int] * 5 + [ctypes.c_void_p]
        lib.qmla_head_ctas.restype = ctypes.c_int
        lib.qmla_head_ctas.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.qmla_ctas_per_sm.restype = ctypes.c_int
        lib.qmla_ctas_per_sm.argtypes = [ctypes.c_int] * 3
        lib.qmla_combine.restype = ctypes.c_int
        lib.qmla_combine.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
                                     + [ctypes.c_int] * 4 + [ctypes.c_void_p])  # fmt: skip
        lib.qmla_error_string.restype = ctypes.c_char_p
        lib.qmla_error_string.argtypes = [ctypes.c_int]
        if hasattr(lib, "qmla_pdl"):  # the sm90 library: whether it was built for programmatic launches
            lib.qmla_pdl.restype = ctypes.c_int
        if hasattr(lib, "qmla_fused_merge"):  # ... and whether its packed-page kernel can merge the splits itself
            lib.qmla_fused_merge.restype = ctypes.c_int
        if lib.qmla_params_size() != ctypes.sizeof(_Params):
            raise CudaBuildError(
                f"Params layout mismatch: library {lib.qmla_params_size()} B, ctypes {ctypes.sizeof(_Params)} B"
            )
        lib._qmla_checked = True
    return lib


@functools.lru_cache(maxsize=64)
def _ctas_per_sm(device_index: int, cbits: int, rbits: int, kernel: str = "mma", heads: int = HEADS_PER_CTA) -> int:
    """Resident CTAs per SM (the CUDA occupancy calculator on the kernel built for ``heads`` query heads;
    CTAS_PER_SM if it fails)."""
    n = _lib(torch.device("cuda", device_index), kernel).qmla_ctas_per_sm(cbits, rbits, heads)
    return n if n > 0 else CTAS_PER_SM[kernel]


FUSED_MAX_SLOTS = 16  # the page kernel merges the splits itself (a library built with QMLA_FUSED_MERGE) only up to
# this many partial slots per sequence: its last CTA reads them alone (at B1 x 128K's ~256 splits, 8 MB)
ARRIVALS = 1 << 16  # counters per (device, stream) for the merge in the page kernel: sequences x head CTAs


_ARRIVALS: dict[tuple[int, int], torch.Tensor] = {}


def _arrivals(device_index: int, stream: int) -> torch.Tensor:
    """The counters of the merge in the page kernel for calls on one stream of one device (zeros; each call leaves
    them zero again; two streams' calls may run at once, so each stream has its own), allocated once and kept for the
    process: a captured CUDA graph holds their address."""
    key = (device_index, stream)
    if key not in _ARRIVALS:
        _ARRIVALS[key] = torch.zeros(ARRIVALS, dtype=torch.int32, device=torch.device("cuda", device_index))
    return _ARRIVALS[key]


@functools.lru_cache(maxsize=16)
def _side_stream(device_index: int):
    """One side stream per device for the BF16 buffer kernel (created on first use, never at import)."""
    return torch.cuda.Stream(device=torch.device("cuda", device_index))


def decode_attention_cuda(q_lat, q_pe, cache, softmax_scale: float, *, num_splits: int | None = None,
                          return_lse: bool = False, kernel: str | None = None):  # fmt: skip
    """CUDA decode attention; same contract as :func:`quantmla.kernels.reference.decode_attention_torch`.
    ``kernel``: ``"mma"``, ``"wgmma"``, ``"ws"`` or ``"auto"`` (default: :func:`cuda_kernel_choice`)."""
    plan = plan_decode(q_lat, q_pe, cache, softmax_scale, num_splits=num_splits, kernel=kernel)
    out, lse = launch_decode(plan)
    return (out, lse) if return_lse else out


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One decode call, checked and laid out: the kernel library, its ``Params``, the split count and the partial
    buffers ``po [B, ns_total, H, Dc]`` / ``pl [B, ns_total, H]`` (slots ``[0, ns)`` the page kernel's, the rest the
    BF16 sink/local buffers'). :func:`launch_decode` runs it; ``benchmarks/decode_breakdown.py`` runs its parts."""

    kernel: str
    lib: object
    params: _Params
    cbits: int
    rbits: int
    head_ctas: int  # CTAs per split and sequence
    ns: int  # page splits
    ns_total: int  # + the buffer tiles
    q_lat: torch.Tensor
    q_pe: torch.Tensor
    cache: object
    softmax_scale: float
    po: torch.Tensor
    pl: torch.Tensor
    one_stream: bool = False  # the buffer kernel just before the page kernel on one stream (programmatic launches)
    pps: int = 1  # pages per split (the merge reads of each sequence the splits with pages: split_plan.used_splits)
    fused: bool = False  # the packed-page kernel merges the splits itself (QMLA_FUSED_MERGE; see fused_merge)


def plan_decode(q_lat, q_pe, cache, softmax_scale: float, *, num_splits: int | None = None,
                kernel: str | None = None) -> DecodePlan:  # fmt: skip
    """Check the call and lay it out (allocates the partial buffers; launches nothing)."""
    from quantmla.kernels.reference import _check_q
    from quantmla.kernels.triton_decode import _num_sms, buffer_tiles

    _check_q(q_lat, q_pe, cache, 3)
    if not (q_lat.is_cuda and q_pe.is_cuda and cache.pool.is_cuda):
        raise RuntimeError("impl='cuda' needs q and the cache on a CUDA device")
    kernel = cuda_kernel_choice(q_lat.device, kernel, cache=cache, heads=q_lat.shape[1])
    reason = cuda_unsupported_reason(cache, kernel)
    if reason:
        raise ValueError(f"impl='cuda' cannot run format {cache.fmt.name!r}: {reason}")
    B, H, Dc = q_lat.shape
    L = cache.layout
    dev = q_lat.device
    if q_lat.dtype not in (torch.bfloat16, torch.float32):
        q_lat = q_lat.float()
    if q_pe.dtype != q_lat.dtype:
        q_pe = q_pe.to(q_lat.dtype)
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    # packed pages per sequence (sorted: the plan depends on their multiset), at the planned length when one is set
    pages = packed_page_counts(tuple(cache.plan_lengths()), cache.n_sink, cache.n_local, L.page_size)
    max_pages = max(1, pages[-1] if pages else 0)
    c, r = cache.fmt.content, cache.fmt.rope
    cbits, rbits = _bits(cache.fmt)
    lib = _lib(dev, kernel)
    hg = lib.qmla_head_ctas(H, cbits)  # CTAs per split and sequence: ceil(H / 16); ws ceil(H / 32)
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    slots = _num_sms(dev) * _ctas_per_sm(dev_index, cbits, rbits, kernel, H)
    ns = num_splits or split_plan(pages, hg, slots)
    ns = max(1, min(ns, max_pages))
    pps = math.ceil(max_pages / ns)
    ns = math.ceil(max_pages / pps)
    ns_total = ns + buffer_tiles(cache)
    po = torch.empty(B, ns_total, H, Dc, dtype=torch.float32, device=dev)
    pl = torch.empty(B, ns_total, H, dtype=torch.float32, device=dev)
    one_stream = cbits != 16 and hasattr(lib, "qmla_pdl") and lib.qmla_pdl() == 1
    # the page kernel may merge the splits (the launch order it needs is fused_merge's to check)
    fused = (cbits != 16 and getattr(lib, "qmla_fused_merge", lambda: 0)() == 1 and ns_total <= FUSED_MAX_SLOTS
             and B * hg <= ARRIVALS)  # fmt: skip
    p = _Params(
        q_lat=q_lat.data_ptr(), q_pe=q_pe.data_ptr(),
        q_lat_sb=q_lat.stride(0), q_lat_sh=q_lat.stride(1), q_pe_sb=q_pe.stride(0), q_pe_sh=q_pe.stride(1),
        pool=cache.pool.data_ptr(), page_bytes=L.page_bytes,
        c_off=L.content_offset, r_off=L.rope_offset, m_off=L.meta_offset,
        c_srow=L.content_scale_row, c_orow=-1 if c is None or c.symmetric else L.content_offset_row,
        r_srow=L.rope_scale_row, r_orow=-1 if r is None or r.symmetric else L.rope_offset_row,
        block_table=cache.block_table.data_ptr(), bt_stride=cache.block_table.stride(0),
        lens=cache.seq_lens.data_ptr(), po=po.data_ptr(), pl=pl.data_ptr(),
        H=H, ns_total=ns_total, pps=pps, sink=cache.n_sink, local=cache.n_local,
        qk_scale=softmax_scale * LOG2E, q_fp32=int(q_lat.dtype == torch.float32),
        c_groups=0 if c is None else c.num_groups(L.kv_lora_rank),
    )  # fmt: skip
    return DecodePlan(kernel, lib, p, cbits, rbits, hg, ns, ns_total, q_lat, q_pe, cache, softmax_scale, po, pl,
                      one_stream, pps, fused)  # fmt: skip


PARTS = ("pages", "buffers", "combine")


def one_stream_order(plan: DecodePlan, parts: tuple[str, ...] = PARTS) -> bool:
    """Whether :func:`launch_decode` runs the buffer kernel on the caller's stream right before the page kernel, which
    then waits for it only at its end (``Params.pdl_late``): only with a library built for programmatic launches
    (``plan.one_stream``), when both kernels are launched and the buffer kernel has tiles at all -- after any other
    kernel the page kernel must wait at its start, before it reads what that kernel wrote."""
    return bool(plan.one_stream and "buffers" in parts and "pages" in parts and plan.ns_total > plan.ns)


def fused_merge(plan: DecodePlan, parts: tuple[str, ...] = PARTS) -> bool:
    """Whether :func:`launch_decode` lets the page kernel merge the splits (``csrc/mla_fused_merge.cuh``) instead of
    launching the merge kernel: a library built with ``QMLA_FUSED_MERGE``, packed pages, at most
    :data:`FUSED_MAX_SLOTS` partial slots, every part launched, and the BF16 buffers' partials complete before the page
    kernel's end (one-stream order, or no buffer slots)."""
    return plan.fused and set(parts) == set(PARTS) and (one_stream_order(plan, parts) or plan.ns_total == plan.ns)


def launch_decode(plan: DecodePlan, parts: tuple[str, ...] = PARTS):
    """Launch ``plan`` on the current stream -> ``(out [B, H, Dc] fp32, lse [B, H])``: the page kernel, the BF16
    sink/local buffers (Triton, on a side stream beside it), the split merge. ``parts``: a subset of :data:`PARTS`
    for timing them apart (``benchmarks/decode_breakdown.py``); without ``"combine"`` it returns ``(None, None)``.
    (The buffer kernel launched before the page kernel on the side stream was never faster: H200, 2026-12-01,
    ``decode_breakdown_h200_s13.md``.)"""
    from quantmla.kernels.triton_decode import attend_buffers

    if not set(parts) <= set(PARTS):
        raise ValueError(f"parts must be among {PARTS}, got {parts}")
    B, H, Dc = plan.q_lat.shape
    dev = plan.q_lat.device
    if B == 0 or H == 0:
        return torch.empty(B, H, Dc, device=dev), torch.empty(B, H, device=dev)
    lib = plan.lib
    stream = torch.cuda.current_stream(dev).cuda_stream
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    out = lse = None
    with torch.cuda.device(dev):
        # the BF16 sink/local buffers (Triton, a few CTAs) run beside the page kernel on a side stream: they
        # write other partial slots, and the combine waits for both (also inside a CUDA graph: fork and join).
        # With programmatic launches (plan.one_stream) they run on this stream just before the page kernel, which
        # starts at once and waits for them only at its end; the merge then follows the page kernel directly.
        cur = torch.cuda.current_stream(dev)
        one = one_stream_order(plan, parts)
        plan.params.pdl_late = int(one)
        side = cur if one else _side_stream(dev_index)
        if not one:
            side.wait_stream(cur)

        def buffers() -> None:
            if "buffers" in parts:
                with torch.cuda.stream(side):
                    attend_buffers(plan.q_lat, plan.q_pe, plan.cache, plan.softmax_scale, plan.po, plan.pl, plan.ns,
                                   launch_dependents=one)  # fmt: skip

        if one:
            buffers()
        fused = fused_merge(plan, parts)
        if fused or "combine" in parts:
            out = torch.empty(B, H, Dc, dtype=torch.float32, device=dev)
            lse = torch.empty(B, H, dtype=torch.float32, device=dev)
        plan.params.arrivals = _arrivals(dev_index, stream).data_ptr() if fused else None
        plan.params.out = out.data_ptr() if fused else None
        plan.params.lse = lse.data_ptr() if fused else None
        if "pages" in parts:
            err = lib.qmla_decode(ctypes.byref(plan.params), plan.cbits, plan.rbits, plan.head_ctas, plan.ns, B,
                                  ctypes.c_void_p(stream))  # fmt: skip
            if err != 0:
                cur.wait_stream(side)
                raise RuntimeError(f"CUDA decode kernel launch failed: {lib.qmla_error_string(err).decode()}")
        if not one:
            buffers()
            cur.wait_stream(side)
        if "combine" in parts and not fused:
            ptrs = [ctypes.c_void_p(x.data_ptr()) for x in (plan.po, plan.pl, out, lse)]
            c = plan.cache
            err = lib.qmla_combine(*ptrs, B, plan.ns_total, H, ctypes.c_void_p(c.seq_lens.data_ptr()), c.n_sink,
                                   c.n_local, plan.pps, plan.ns, ctypes.c_void_p(stream))  # fmt: skip
            if err != 0:
                raise RuntimeError(f"CUDA combine kernel launch failed: {lib.qmla_error_string(err).decode()}")
    return out, lse
