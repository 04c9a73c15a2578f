"""The CUDA decode kernels compile offline (nvcc only, no GPU) for the chips they are built for, with no register
spills, and the Hopper kernels without ptxas serializing their wgmma batches (warnings C7512 / C7514 / C7515: every
wgmma would wait for the one before, the design's overlap gone). Skipped where no nvcc is installed (CI has none)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from quantmla.kernels.cuda_build import CSRC, find_nvcc

NVCC = find_nvcc()


def _nvcc_major() -> int:
    if NVCC is None:
        return 0
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else 0


pytestmark = pytest.mark.skipif(
    _nvcc_major() < 12, reason="needs nvcc >= 12 (sm_90a, wgmma): pip install nvidia-cuda-nvcc-cu12"
)


@pytest.mark.parametrize(
    "name,arch,defines",
    [("decode_mla", "80", ()), ("decode_mla", "80", ("-DQMLA_Q_VEC=0",)), ("decode_mla", "90", ()),
     ("decode_mla_sm90", "90a", ()),
     ("decode_mla_sm90", "90a", ("-DQMLA_SM90_PV_F16=0", "-DQMLA_COMBINE_WIDE=0", "-DQMLA_Q_VEC=0")),  # off3
     ("decode_mla_sm90", "90a", ("-DQMLA_PDL=1", "-DQMLA_COMBINE_V4=1", "-DQMLA_SM90_ST2=1")),
     ("decode_mla", "80", ("-DQMLA_COMBINE_V4=1",)),
     ("decode_mla_sm90", "90a", ("-DQMLA_SM90_QPREP=1", "-DQMLA_SM90_SCORE2=1", "-DQMLA_SM90_META_EARLY=1")),
     ("decode_mla_sm90_h64", "90a", ())],
)  # fmt: skip
def test_kernel_compiles_without_spills_or_serialized_wgmma(name, arch, defines, tmp_path):
    cmd = [NVCC, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", *defines, "-cubin",
           "-o", str(tmp_path / "k.cubin"), str(CSRC / f"{name}.cu"), "-Xptxas", "-v"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and not any(spills), f"register spills: {spills}"
    serialized = [ln for ln in log.splitlines() if any(c in ln for c in ("C7512", "C7514", "C7515"))]
    assert not serialized, "ptxas serialized the wgmma pipeline:\n" + "\n".join(serialized)
    if name.startswith("decode_mla_sm90"):
        assert len(re.findall(r"Used (\d+) registers", log)) >= 8  # the eight instantiations were built


@pytest.mark.parametrize("kernel", ["mma", "wgmma", "wgmma64"])
def test_library_builds_and_its_host_side_answers_without_a_gpu(kernel, tmp_path, monkeypatch):
    """The shared library (device + host code, the build `impl="cuda"` makes) loads on a machine without a GPU: its
    Params matches the ctypes mirror, and the entry points that need a GPU return a CUDA error code, not a crash."""
    import ctypes

    from quantmla.kernels.cuda_build import build
    from quantmla.kernels.cuda_decode import _SOURCES, _Params

    monkeypatch.setenv("QUANTMLA_CACHE", str(tmp_path))
    name, arch = _SOURCES[kernel]
    lib = ctypes.CDLL(str(build(name, arch or "90")))
    lib.qmla_params_size.restype = ctypes.c_int
    assert lib.qmla_params_size() == ctypes.sizeof(_Params)
    lib.qmla_error_string.restype = ctypes.c_char_p
    for f in ("qmla_ctas_per_sm", "qmla_decode", "qmla_head_ctas"):
        getattr(lib, f).restype = ctypes.c_int
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        assert lib.qmla_ctas_per_sm(4, 4, 16) == -1
        p = _Params()
        err = lib.qmla_decode(ctypes.byref(p), 4, 4, 1, 1, 1, None)
        assert err != 0 and lib.qmla_error_string(err)
    assert lib.qmla_ctas_per_sm(3, 4, 16) == -1  # no 3-bit kernel
    # CTAs per split and sequence: 16 heads each (mma, wgmma), 64 (wgmma64), for every format
    per_cta = 64 if kernel == "wgmma64" else 16
    for h in (1, 16, 17, 32, 33, 64, 65, 128):
        assert all(lib.qmla_head_ctas(h, bits) == -(-h // per_cta) for bits in (16, 8, 4, 2))
    assert lib.qmla_decode(ctypes.byref(_Params()), 2, 8, 1, 1, 1, None) == 1  # C2R8: not built (invalid value)
    if kernel == "mma":
        assert lib.qmla_ctas_per_sm(8, 8) == -1  # the mma kernel has no 8-bit path


@pytest.mark.parametrize("pdl,qprep", [(0, 0), (1, 0), (1, 1)])
def test_programmatic_launch_instructions_are_where_qmla_pdl_puts_them(pdl, qprep, tmp_path):
    """QMLA_PDL=1: every page kernel lets its dependents launch (griddepcontrol.launch_dependents -> PREEXIT), every
    split merge waits for its prerequisite grids before reading (griddepcontrol.wait -> ACQBULK), and the packed
    page kernels, launched programmatically themselves, wait for the kernel before them (at the start, at the end
    after the buffer kernel, or before reading the q prep kernel's workspace with QMLA_SM90_QPREP=1, whose prep
    kernels let them launch); the BF16 page kernel (launched normally) never waits. With 0 (the default) neither
    instruction is in the library."""
    cubin = tmp_path / "k.cubin"
    cmd = [NVCC, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-DQMLA_PDL={pdl}",
           f"-DQMLA_SM90_QPREP={qprep}", "-cubin", "-o", str(cubin), str(CSRC / "decode_mla_sm90.cu")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    sass = subprocess.run([str(Path(NVCC).parent / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    funcs = {f.split("\n", 1)[0].strip(): f for f in re.split(r"\n\s*Function : ", sass)[1:]}
    packed = [f for n, f in funcs.items() if "decode_kernel_sm90I" in n]
    bf16 = [f for n, f in funcs.items() if "decode_kernel_sm90_bf16" in n]
    merges = [f for n, f in funcs.items() if "combine" in n]  # scalar (3) and 16-byte (6) split merges
    preps = [f for n, f in funcs.items() if "qprep_kernel" in n]
    assert len(packed) == 16 and len(bf16) == 1 and len(merges) == 9 and len(preps) == (16 if qprep else 0)
    assert all(("PREEXIT" in f) == bool(pdl) for f in packed + bf16 + preps)
    assert all(("ACQBULK" in f) == bool(pdl) for f in merges)
    assert all(("ACQBULK" in f) == bool(pdl) for f in packed)
    assert not any("ACQBULK" in f for f in bf16 + preps)


@pytest.mark.parametrize("qprep", [0, 1])
def test_q_preparation_entry_points_answer_without_a_gpu(qprep, tmp_path, monkeypatch):
    """The sm90 library says how many workspace bytes per (sequence, head group) its page kernel reads (0: it stages q
    in every CTA, the default), and cuda_decode's plan sizes the workspace from that; without a GPU the prep launch
    returns a CUDA error code, not a crash; a format without a prep kernel (BF16 pages) is refused."""
    import ctypes

    import torch

    from quantmla.kernels.cuda_build import build
    from quantmla.kernels.cuda_decode import _Params

    monkeypatch.setenv("QUANTMLA_CACHE", str(tmp_path))
    lib = ctypes.CDLL(str(build("decode_mla_sm90", "90a", extra=(f"-DQMLA_SM90_QPREP={qprep}",))))
    lib.qmla_qprep_bytes.restype = lib.qmla_qprep.restype = ctypes.c_int
    lib.qmla_params_size.restype = ctypes.c_int
    assert lib.qmla_params_size() == ctypes.sizeof(_Params)
    # 36 k-blocks x 16 heads x 16 fp16 + 2 x 5 x 16 floats + e, rounded up to 128 bytes
    assert lib.qmla_qprep_bytes() == (36 * 16 * 16 * 2 + 2 * 5 * 16 * 4 + 128 if qprep else 0)
    p = _Params()
    assert lib.qmla_qprep(ctypes.byref(p), 16, 16, 1, 1, None) != 0  # BF16 pages: no prep kernel
    if not torch.cuda.is_available():
        assert lib.qmla_qprep(ctypes.byref(p), 4, 4, 1, 1, None) != 0
