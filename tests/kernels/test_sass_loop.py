"""``benchmarks/sass_loop.py`` on this machine's nvcc (skipped without one): it finds each packed format's page loop
(the HGMMA inside it); the default build writes the (P s)^T tiles as ``QMLA_SM90_P_STSM`` says -- one stmatrix
per content group and no two-byte stores, where the former form (``=0``) has 32 -- turns 8-bit codes into fp16 with
PRMT (``QMLA_PRMT8``), and keeps every ldmatrix and page copy with fewer instructions around them (the address
bases), each with fewer instructions per tile than the former form. (The PRMT byte selectors themselves are checked
against the shift + LOP3 form in ``test_prmt_selectors_equal_the_shift_and_mask``.)"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (pip install nvidia-cuda-nvcc)")


def _tool():
    spec = importlib.util.spec_from_file_location("sass_loop", os.path.join(HERE, "..", "..", "benchmarks",
                                                                            "sass_loop.py"))  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_nvcc
def test_levers_change_the_instructions_they_name():
    """The levers are the defaults (session 22); each is compared with its former form (macro = 0)."""
    sl = _tool()
    ops = {}
    addr = ["QMLA_SM90_ADDR_BASES=0", "QMLA_PAGE_BASES=0"]
    for name, defines in (("base", []), ("nopstsm", ["QMLA_SM90_P_STSM=0"]), ("noprmt8", ["QMLA_PRMT8=0"]),
                          ("noaddr", addr), ("magic", ["QMLA_SM90_SUBNORMAL=0"])):  # fmt: skip
        sass = sl.compile_sass(defines)
        ops[name] = {f: collections.Counter(sl.opcode(x) for x in sl.loop_of(sass, f)) for f in sl.FORMATS}
    for f in (f for f in sl.FORMATS if not f.endswith("t")):  # four content groups (the T formats: one)
        old, new = ops["nopstsm"][f], ops["base"][f]
        assert old["HGMMA.64x16x16.F32"] == new["HGMMA.64x16x16.F32"] == 68  # 36 score + 32 output products
        assert old["STS.U16"] == 32 and new["STS.U16"] == 0, f
        assert sum(v for k, v in new.items() if k.startswith("STSM")) == 4, f  # 4 content groups
        assert sum(new.values()) < sum(old.values()) - 40, f
    # QMLA_PRMT8: 8-bit codes with one PRMT per pair and no shift; the 4/2-bit formats' loops are untouched
    for f in ("c4r4", "c2r4"):
        assert ops["noprmt8"][f] == ops["base"][f], f
    eight, old8 = ops["base"]["c8r8"], ops["noprmt8"]["c8r8"]
    assert eight["PRMT"] > old8["PRMT"] + 200  # 72 score + 64 output registers, two fields each
    assert sum(eight.values()) < sum(old8.values()) - 100
    # the address bases: the same LDSM / LDGSTS, never more instructions around them (C8R8: > 100 fewer)
    for f in sl.FORMATS:
        for op in ("LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128"):
            assert ops["base"][f][op] == ops["noaddr"][f][op], (f, op)
        assert sum(ops["base"][f].values()) <= sum(ops["noaddr"][f].values()), f
        if f in ("c4r4", "c4r8"):  # (C2R4, C2R4T: equal since session 28's ldmatrix two batches ahead)
            assert sum(ops["base"][f].values()) < sum(ops["noaddr"][f].values()), f
    assert sum(ops["base"]["c8r8"].values()) < sum(ops["noaddr"]["c8r8"].values()) - 100
    # QMLA_SM90_SUBNORMAL (default since session 28): codes as fp16 subnormals -- the output product's 128 HFMA2 per
    # thread and tile (magic number minus 1024) are gone in every format, the unpacking keeps its count (one LOP3 or
    # PRMT per pair either way; the compiler's own moves aside), the same 68 products and no more wgmma arrivals (ptxas
    # serializing the products would add them); the T formats' content groups share one score accumulator (> 150
    # fewer: 1,249 -> 1,055 for C4R4T)
    for f in sl.FORMATS:
        sub, magic = ops["base"][f], ops["magic"][f]
        assert magic["HFMA2"] == 128 and sub["HFMA2"] == 0, f
        assert sub["HGMMA.64x16x16.F32"] == magic["HGMMA.64x16x16.F32"] == 68, f
        unpack = "PRMT" if f == "c8r8" else "LOP3.LUT"
        assert abs(sub[unpack] - magic[unpack]) <= 20, (f, sub[unpack], magic[unpack])
        assert sum(sub.values()) < sum(magic.values()) - (150 if f.endswith("t") else 100), f
        assert sub["WARPGROUP.ARRIVE"] == magic["WARPGROUP.ARRIVE"], f


def prmt(a: int, b: int, s: int) -> int:
    """PTX prmt.b32, default mode: byte i of the result is byte s_i (nibble i of s, 0-7) of the eight bytes {b, a}."""
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(pool[(s >> 4 * i) & 0x7] << 8 * i for i in range(4))


def _prmt_selectors() -> list[int]:
    import re

    src = open(os.path.join(HERE, "..", "..", "src", "quantmla", "kernels", "csrc", "mla_ops.cuh")).read()
    return [int(x, 16) for x in re.search(r"b \? (0x[0-9a-f]+)u : (0x[0-9a-f]+)u", src).groups()]  # (b = 1, b = 0)


def test_prmt_selectors_equal_the_shift_and_mask():
    """mla_ops.cuh magic_bytes: PRMT of (r, 0x64006400) with selectors 0x5250 / 0x5351 gives byte b of each 16-bit
    half under the magic's 0x64 byte, as ``(r >> 8 b) & 0x00FF00FF | 0x64006400`` (PTX prmt, default mode: byte i
    of the result is byte sel_i of the eight bytes {b, a}); bit-exact on random words."""
    import random
    import re

    src = open(os.path.join(HERE, "..", "..", "src", "quantmla", "kernels", "csrc", "mla_ops.cuh")).read()
    sel = _prmt_selectors()
    magic = int(re.search(r"kMagicF16 = (0x[0-9a-f]+)u", src).group(1), 16)

    rng = random.Random(0)
    for _ in range(5000):
        r = rng.getrandbits(32)
        for b, s in ((1, sel[0]), (0, sel[1])):
            assert prmt(r, magic, s) == ((r >> 8 * b) & 0x00FF00FF) | magic


def test_subnormal_fields_are_the_exact_codes():
    """QMLA_SM90_SUBNORMAL (mla_ops.cuh score_fields / code_f16 / magic_bytes with SUB): a b-bit field of the low byte
    of each 16-bit half, masked in place (the upper byte first shifted down by 8), and a byte put under a zero byte by
    PRMT, are fp16 numbers equal to 2^(b p) c 2^-24 exactly -- checked against numpy's fp16 decoding of every code at
    every plane, both halves, on random words (what the kernel undoes: 2^-24 in the softmax scale and per plane in
    the epilogue)."""
    import random

    import numpy as np

    def f16(bits16: int) -> float:
        return float(np.array([bits16], dtype=np.uint16).view(np.float16)[0])

    rng = random.Random(1)
    for bits in (2, 4):
        planes = 8 // bits
        for _ in range(500):
            r = rng.getrandbits(32)
            for word in (r, r >> 8):  # low byte of each half; the upper byte in place after one shift
                for p in range(planes):
                    mask = (((1 << bits) - 1) << (bits * p)) * 0x00010001
                    y = word & mask
                    for half in (0, 1):
                        c = (word >> (16 * half + bits * p)) & ((1 << bits) - 1)
                        assert f16((y >> 16 * half) & 0xFFFF) == c * 2.0 ** (bits * p) * 2.0**-24
    sel = _prmt_selectors()
    for _ in range(500):  # 8-bit codes: PRMT of (r, 0) with the kernel's selectors, byte b of each half over zero
        r = rng.getrandbits(32)
        for b, s in ((1, sel[0]), (0, sel[1])):
            y = prmt(r, 0, s)
            for half in (0, 1):
                c = (r >> (16 * half + 8 * b)) & 0xFF
                assert f16((y >> 16 * half) & 0xFFFF) == c * 2.0**-24


def test_address_bases_are_the_same_addresses():
    """The identities behind QMLA_SM90_ADDR_BASES / QMLA_PAGE_BASES, over every lane, batch and round: a swizzled
    chunk (c ^ (token & 7)) of the staged page computed from a per-tile base plus a constant."""
    for lane7 in range(8):
        for b in (0, 1):
            for j in range(16):  # score product, content batch j: chunk 2j + b of the lane's token
                assert (2 * j + b) ^ lane7 == 8 * (j // 4) + ((2 * (j % 4) + b) ^ lane7)
        for gr in range(4):  # 8-bit output product: chunk 8 gr + w + 4 m
            for w in range(4):
                for m in (0, 1):
                    assert (8 * gr + w + 4 * m) ^ lane7 == 8 * gr + ((w + 4 * m) ^ lane7)
    cbytes = 512  # C8R8's page copy: 128 threads, 32 chunks per token row, 4 tokens per round
    for step in (1, 2, 4):
        per = 8 // step
        for n0 in range(step):
            for x in range(32):
                for i in range(64 // step):
                    nn, nk = n0 + i * step, n0 + (i % per) * step
                    base = nk * cbytes + 16 * (x ^ (nk & 7))
                    assert nn * cbytes + 16 * (x ^ (nn & 7)) == base + (i // per) * 8 * cbytes


@needs_nvcc
def test_token_scale_formats_share_one_p_tile_and_one_fold():
    """C4R4T / C2R4T (one content scale per token: the kernel's TS instantiation) write one (P s)^T tile per tile
    instead of C4R4 / C2R4's four and issue the same 68 products with > 150 fewer instructions around them (the
    content groups' scores summed unscaled and scaled once: 1,420 -> 1,249 for C4R4T, 2026-12-03)."""
    sl = _tool()
    sass = sl.compile_sass([])
    ops = {f: collections.Counter(sl.opcode(x) for x in sl.loop_of(sass, f)) for f in sl.FORMATS}
    for f in ("c4r4", "c2r4"):
        ts, base = ops[f + "t"], ops[f]
        assert ts["HGMMA.64x16x16.F32"] == base["HGMMA.64x16x16.F32"] == 68, f
        assert sum(v for k, v in ts.items() if k.startswith("STSM")) == 1, f
        assert sum(v for k, v in base.items() if k.startswith("STSM")) == 4, f
        assert sum(ts.values()) < sum(base.values()) - 150, f


@needs_nvcc
def test_ablations_take_away_what_they_name():
    """QMLA_SM90_ABLATE (mla_sm90_ablate.cuh, timing only): 3 leaves the page loop without tensor-core products, 4
    without the unpacking (every product still there, the LOP3 / SHF of the codes gone), 8 with the same copies and
    products (the page address changes, one instruction more)."""
    sl = _tool()
    loops = {m: sl.compile_sass([f"QMLA_SM90_ABLATE={m}"] if m else []) for m in (0, 3, 4, 8)}
    for f in ("c4r4", "c4r4t"):
        ops = {m: collections.Counter(sl.opcode(x) for x in sl.loop_of(s, f)) for m, s in loops.items()}
        # (without products ptxas puts one empty HGMMA.64x8x16 on zero registers in each commit group: not counted)
        hgmma = {m: sum(v for k, v in o.items() if k.startswith("HGMMA.64x16x16")) for m, o in ops.items()}
        assert hgmma == {0: 68, 3: 0, 4: 68, 8: 68}, f
        fam = {m: collections.Counter(k.split(".")[0] for k in o.elements()) for m, o in ops.items()}
        assert fam[4]["LOP3"] < fam[0]["LOP3"] - 200 and fam[4]["SHF"] < fam[0]["SHF"] - 50, f
        for op in ("LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128"):
            assert ops[8][op] == ops[0][op] > 0, (f, op)
        assert abs(sum(ops[8].values()) - sum(ops[0].values())) <= 2, f
