"""Build-on-first-use of quantmla's CUDA C++ kernels (``kernels/csrc/*.cu``) and loading them with ctypes.

The kernels are plain CUDA C++ with a C entry point (no torch headers, no pybind), compiled by ``nvcc`` for the
GPU in use (``-gencode arch=compute_XY,code=sm_XY``) into a shared library cached under
``$QUANTMLA_CACHE/cuda`` (default ``~/.cache/quantmla/cuda``), keyed by the source's hash, the architecture and
the nvcc version; the write is atomic (temp file + rename), so concurrent first uses are safe.

``$QUANTMLA_CUDA_SRC`` points the build at another source folder (development, mutation tests).
``nvcc`` is looked up in ``$QUANTMLA_NVCC``, ``PATH``, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin`` and the
``nvidia-cuda-nvcc`` wheel (``pip install nvidia-cuda-nvcc-cu12`` or ``-cu13``). Nothing here runs at import time
and nothing touches CUDA until :func:`load` is called.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
_LIBS: dict[tuple[str, str], ctypes.CDLL] = {}


class CudaBuildError(RuntimeError):
    """The CUDA kernels could not be built or loaded (no nvcc, compiler error, no GPU)."""


def find_nvcc() -> str | None:
    """Path of an nvcc executable, or None."""
    cands = [os.environ.get("QUANTMLA_NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "nvcc"))
    try:  # the nvidia-cuda-nvcc wheel
        import nvidia.cuda_nvcc as m  # type: ignore[import-not-found]

        for base in getattr(m, "__path__", []):
            cands.append(os.path.join(base, "bin", "nvcc"))
    except ImportError:
        pass
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cache_dir() -> Path:
    root = os.environ.get("QUANTMLA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "quantmla")
    return Path(root) / "cuda"


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def source_key(src: Path, flags: list[str], nvcc_version: str) -> str:
    """Cache key of a build: the source, every header beside it (``decode_mla.cu`` includes ``mla_ops.cuh`` and
    ``mla_combine.cuh``), the flags and the compiler version."""
    text = src.read_bytes() + b"".join(h.name.encode() + h.read_bytes() for h in sorted(src.parent.glob("*.cuh")))
    return hashlib.sha256(text + " ".join(flags).encode() + nvcc_version.encode()).hexdigest()[:16]


def build(name: str, arch: str, *, nvcc: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """Compile ``csrc/<name>.cu`` for ``arch`` (e.g. ``"90"``, ``"90a"``, ``"80"``) unless cached; return the
    library's path. Raises :class:`CudaBuildError` with the compiler's message on failure."""
    src = Path(os.environ.get("QUANTMLA_CUDA_SRC") or CSRC) / f"{name}.cu"
    if not src.is_file():
        raise CudaBuildError(f"kernel source {src} is missing (broken installation?)")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError(
            "the quantmla CUDA kernels are compiled on first use, but no nvcc was found: install the CUDA toolkit "
            "or `pip install nvidia-cuda-nvcc-cu12` (or -cu13), or set QUANTMLA_NVCC; or use impl='triton'"
        )
    flags = ["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared", "-Xcompiler", "-fPIC",
             "-lineinfo", *extra]  # fmt: skip
    key = source_key(src, flags, _nvcc_version(nvcc))
    out = cache_dir() / f"{name}-sm{arch}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([nvcc, *flags, "-o", tmp, str(src)], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise CudaBuildError(f"nvcc failed to build {src.name} for sm_{arch}:\n{res.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def device_arch(device) -> str:
    """``"90"`` style architecture string of a CUDA device."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def load(name: str, device, arch: str | None = None) -> ctypes.CDLL:
    """The compiled library ``name`` for ``device``'s architecture, or for ``arch`` (e.g. ``"90a"``: the
    architecture-specific Hopper target that ``wgmma`` needs); built on first use, cached per process."""
    arch = arch or device_arch(device)
    key = (name, arch)
    if key not in _LIBS:
        path = build(name, arch)
        try:
            _LIBS[key] = ctypes.CDLL(str(path))
        except OSError as e:
            raise CudaBuildError(f"could not load {path}: {e}") from e
    return _LIBS[key]
