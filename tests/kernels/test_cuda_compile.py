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
     ("decode_mla_sm90", "90a", ("-DQMLA_PDL=0", "-DQMLA_COMBINE_V4=1")),
     ("decode_mla", "80", ("-DQMLA_COMBINE_V4=1",)),
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


@pytest.mark.parametrize("pdl", [0, 1])
def test_programmatic_launch_instructions_are_where_qmla_pdl_puts_them(pdl, tmp_path):
    """QMLA_PDL=1 (the default): every page kernel lets its dependents launch (griddepcontrol.launch_dependents ->
    PREEXIT); every split merge waits for its prerequisite grids (griddepcontrol.wait -> ACQBULK) before its first
    global load, so no load of the partials can be moved above the wait; the packed page kernels, launched
    programmatically themselves, wait for the kernel before them (at the start, or at the end after the buffer
    kernel); the BF16 page kernel (launched normally) never waits. With 0 neither instruction is in the library."""
    cubin = tmp_path / "k.cubin"
    cmd = [NVCC, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-DQMLA_PDL={pdl}", "-cubin",
           "-o", str(cubin), str(CSRC / "decode_mla_sm90.cu")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    sass = subprocess.run([str(Path(NVCC).parent / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    funcs = {f.split("\n", 1)[0].strip(): f for f in re.split(r"\n\s*Function : ", sass)[1:]}
    packed = [f for n, f in funcs.items() if "decode_kernel_sm90I" in n]
    bf16 = [f for n, f in funcs.items() if "decode_kernel_sm90_bf16" in n]
    merges = [f for n, f in funcs.items() if "combine" in n]  # scalar (3) and 16-byte (6) split merges
    assert len(packed) == 16 and len(bf16) == 1 and len(merges) == 9
    assert all(("PREEXIT" in f) == bool(pdl) for f in packed + bf16)
    assert all(("ACQBULK" in f) == bool(pdl) for f in merges)
    assert all(f.count("ACQBULK") == 2 * pdl for f in packed)  # at the start or at the end (Params.pdl_late)
    assert not any("ACQBULK" in f for f in bf16)
    if pdl:
        for f in merges:
            assert re.search(r"\bLDG\b", f) and f.index("ACQBULK") < re.search(r"\bLDG\b", f).start()
