"""The CUDA kernel's build plumbing on the CPU: the cache key covers every source the compiler reads, and the
installed package carries those sources (a wheel without them would silently fall back to Triton)."""

from __future__ import annotations

import ast
import fnmatch
import re
import shutil
from pathlib import Path

import pytest

from quantmla.kernels.cuda_build import CSRC, source_key

ROOT = Path(__file__).resolve().parents[2]


def test_build_key_covers_the_included_headers(tmp_path):
    for f in Path(CSRC).iterdir():
        shutil.copy(f, tmp_path / f.name)
    src = tmp_path / "decode_mla.cu"
    base = source_key(src, ["-O3"], "nvcc 13.0")
    assert '#include "mla_ops.cuh"' in src.read_text()  # what the key must follow
    (tmp_path / "mla_ops.cuh").write_text((tmp_path / "mla_ops.cuh").read_text() + "\n// changed\n")
    assert source_key(src, ["-O3"], "nvcc 13.0") != base
    assert source_key(src, ["-O2"], "nvcc 13.0") != source_key(src, ["-O3"], "nvcc 13.0")
    assert source_key(src, ["-O3"], "nvcc 12.8") != source_key(src, ["-O3"], "nvcc 13.0")


def test_package_data_ships_every_kernel_source():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the package supports 3.10)
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^"quantmla\.kernels"\s*=\s*(\[.*?\])', section, re.M)
    assert m, "no package data for quantmla.kernels"
    patterns = ast.literal_eval(m.group(1))
    sources = [p.relative_to(Path(CSRC).parent).as_posix() for p in Path(CSRC).iterdir() if p.is_file()]
    assert sources, "no kernel sources found"
    for rel in sources:
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), f"{rel} is not in the package data"


def test_cuda_kernel_choice_rejects_an_unknown_kernel_before_touching_cuda(monkeypatch):

    from quantmla.kernels.cuda_decode import KERNEL_ENV, cuda_kernel_choice

    with pytest.raises(ValueError, match="mma.*wgmma.*'tensorcore'"):
        cuda_kernel_choice("cpu", "tensorcore")
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        cuda_kernel_choice("cpu")


def test_every_kernel_source_is_in_the_build_table():
    """Each .cu file is a library the host side can load (a new kernel is not forgotten in _SOURCES)."""
    from quantmla.kernels.cuda_decode import _SOURCES

    built = {name for name, _ in _SOURCES.values()}
    assert {p.stem for p in Path(CSRC).glob("*.cu")} == built


def test_each_cuda_kernel_names_the_formats_it_is_built_for():
    from quantmla.kernels.cuda_decode import cuda_unsupported_reason
    from quantmla.kernels.paged import PagedMLACache
    from quantmla.quant.formats import get_format

    def cache(name):
        return PagedMLACache(name, 1, 64, num_pages=2)

    for kernel in ("mma", "wgmma"):
        assert cuda_unsupported_reason(cache("c4r4"), kernel) == ""
        assert cuda_unsupported_reason(cache("c2r4"), kernel) == ""
    assert cuda_unsupported_reason(cache("c8r8"), "wgmma") == ""
    assert cuda_unsupported_reason(cache("c4r8"), "wgmma") == ""
    why = cuda_unsupported_reason(cache("c8r8"), "mma")
    assert "mma" in why and "C4R4" in why and "C8R8" in why
    assert cuda_unsupported_reason(cache("bf16"), "wgmma") == ""  # BF16 pages: the wgmma kernel only
    assert "no BF16 pages" in cuda_unsupported_reason(cache("bf16"), "mma")
    assert "both paths" in cuda_unsupported_reason(cache("c4r16"), "wgmma")
    assert get_format("c8r8").content.bits == 8  # (the format the message names)


def test_auto_kernel_choice_follows_the_measured_rule(monkeypatch):
    """``auto``: mma off sm_90; on sm_90 wgmma up to 16 heads for every format at every size (measured ahead of mma
    up to B64 x 128K); past 16 heads ws for C4R4 and C2R4, wgmma for the other quantized formats (no GPU: the
    capability query is replaced)."""
    import torch

    from quantmla.kernels import cuda_decode as cd
    from quantmla.kernels.paged import PagedMLACache

    def cache(name, lens):
        c = PagedMLACache(name, len(lens), max(lens), num_pages=64)
        c.write_reference(torch.zeros(len(lens), max(lens), 512), torch.zeros(len(lens), max(lens), 64), lens)
        return c

    monkeypatch.delenv(cd.KERNEL_ENV, raising=False)
    dev = torch.device("cuda", 0)
    small = cache("c4r4", [100, 128])
    for cap, expect in (((8, 0), ("mma", "mma", "mma")), ((9, 0), ("wgmma", "ws", "wgmma"))):
        monkeypatch.setattr(cd, "_device_capability", lambda index, cap=cap: cap)
        got = (cd.cuda_kernel_choice(dev, cache=small, heads=16), cd.cuda_kernel_choice(dev, cache=small, heads=17),
               cd.cuda_kernel_choice(dev, cache=cache("c8r8", [2000]), heads=16))  # fmt: skip
        assert got == expect, (cap, got)
        assert cd.cuda_kernel_choice(dev, "mma", cache=cache("c2r4", [5]), heads=1) == "mma"  # asked for: kept
        small.planned_length = 1 << 23  # planned for 8M tokens (2^24 units, past the 2^21 where mma used to take over)
        assert cd.cuda_kernel_choice(dev, cache=small, heads=16) == ("wgmma" if cap == (9, 0) else "mma")
        small.planned_length = None
        # past WGMMA_AUTO_MAX_HEADS auto takes ws for C4R4 and C2R4 on sm_90 (measured faster than mma at 32-128
        # heads: decode_vs_flashmla_h200_ws.md, decode_vs_flashmla_h200_ws2_s18.md), mma for the rest (mma has no
        # C8R8 -> Triton); at 16 heads C2R4 stays on wgmma
        tiny, tiny2 = cache("c4r4", [3]), cache("c2r4", [3])
        for c in (tiny, tiny2):
            many = cd.cuda_kernel_choice(dev, cache=c, heads=cd.WGMMA_AUTO_MAX_HEADS + 1)
            assert many == ("ws" if cap == (9, 0) else "mma"), (cap, c.fmt)
        assert cd.cuda_kernel_choice(dev, cache=tiny2, heads=32) == ("ws" if cap == (9, 0) else "mma")
        assert cd.cuda_kernel_choice(dev, cache=tiny2, heads=16) == ("wgmma" if cap == (9, 0) else "mma")
        # C8R8 / C4R8 past 16 heads: the wgmma kernel's 16-head CTAs on sm_90 (measured 2-6x faster than Triton and
        # ahead of the removed wgmma64 kernel, decode_vs_flashmla_h200_s19_8bit_heads.md), mma's refusal (-> Triton)
        # elsewhere
        for name in ("c8r8", "c4r8"):
            for heads in (cd.WGMMA_AUTO_MAX_HEADS + 1, 128):
                got = cd.cuda_kernel_choice(dev, cache=cache(name, [3]), heads=heads)
                assert got == ("wgmma" if cap == (9, 0) else "mma"), (cap, name, heads, got)
        if cap == (9, 0):
            assert cd.cuda_kernel_choice(dev, "wgmma", cache=tiny, heads=64) == "wgmma"  # asked for: runs
            # hm (64 heads on M) from HM_AUTO_MIN_HEADS (33) on for C4R4 / C2R4 (measured 1.25-1.43x ws at 64 / 128
            # heads, decode_vs_flashmla_h100_hm_s37.md); ws keeps 17-32 heads (ahead of hm at 32); asked for: runs
            assert cd.cuda_kernel_choice(dev, "hm", cache=tiny, heads=16) == "hm"
            assert cd.cuda_kernel_choice(dev, "ws", cache=tiny, heads=128) == "ws"
            for c in (tiny, tiny2):
                assert [cd.cuda_kernel_choice(dev, cache=c, heads=h) for h in (17, 32, 33, 64, 128)] == [
                    "ws", "ws", "hm", "hm", "hm"]  # fmt: skip
    monkeypatch.setattr(cd, "_device_capability", lambda index: (8, 0))
    for kernel in ("wgmma", "ws", "hm"):  # the sm_90a kernels off sm_90
        with pytest.raises(RuntimeError, match="sm_80.*kernel='mma'"):
            cd.cuda_kernel_choice(dev, kernel)
    # hm is built for C4R4 / C2R4 only: the other formats are refused with the reason (auto never asks it)
    assert "C4R4, C2R4" in cd.cuda_unsupported_reason(cache("c8r8", [3]), "hm")
    assert cd.cuda_unsupported_reason(cache("c4r4", [3]), "hm") == ""


def test_bf16_pages_take_the_wgmma_kernel_only_for_small_work(monkeypatch):
    """``auto`` with BF16 pages: the wgmma kernel on sm_90 while sequences x 16-head groups x longest length stays
    within BF16_WGMMA_MAX_WORK (the boundary itself included), Triton above, off sm_90, or when the environment names
    a kernel; and the dispatcher follows that answer (no GPU: capability, availability and the tensor's device are
    replaced)."""
    import torch

    from quantmla.kernels import cuda_decode as cd
    from quantmla.kernels import dispatch
    from quantmla.kernels.paged import PagedMLACache
    from quantmla.quant.formats import get_format

    def cache(lens):
        c = PagedMLACache("bf16", len(lens), max(lens), num_pages=64)
        c.write_reference(torch.zeros(len(lens), max(lens), 512), torch.zeros(len(lens), max(lens), 64), lens)
        return c

    monkeypatch.delenv(cd.KERNEL_ENV, raising=False)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(cd, "BF16_WGMMA_MAX_WORK", 256)
    monkeypatch.setattr(dispatch, "cuda_kernel_available", lambda device, kernel="mma": True)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    dev = torch.device("cuda", 0)
    small = cache([100, 128])  # 2 x 1 x 128 = 256 units at 16 heads, 512 at 17

    class FakeCudaQuery:  # what resolve_impl reads of q: its device and head count
        is_cuda = True
        device = dev

        def __init__(self, heads):
            self.shape = (2, heads, 512)

    for cap in ((9, 0), (8, 0)):
        monkeypatch.setattr(cd, "_device_capability", lambda index, cap=cap: cap)
        on_sm90 = cap == (9, 0)
        assert cd.bf16_pages_on_cuda(dev, small, 16) is on_sm90
        assert cd.bf16_pages_on_cuda(dev, small, 17) is False
        def auto(heads):
            return dispatch.resolve_impl("auto", FakeCudaQuery(heads), get_format("bf16"), kernel="decode", cache=small)

        assert auto(16) == ("cuda" if on_sm90 else "triton")
        assert auto(17) == "triton"
    monkeypatch.setattr(cd, "_device_capability", lambda index: (9, 0))
    monkeypatch.setenv(cd.KERNEL_ENV, "wgmma")  # a kernel named in the environment: BF16 pages stay on Triton
    assert cd.bf16_pages_on_cuda(dev, small, 16) is False
