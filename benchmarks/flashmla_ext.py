"""Build FlashMLA's SM90 dense BF16 decode from a user-supplied FlashMLA checkout, at run time, for side-by-side
timing (``bench_decode.py --flashmla DIR``). Nothing of FlashMLA is vendored in quantmla: DIR is a checkout of
github.com/deepseek-ai/FlashMLA with its ``csrc/cutlass`` submodule (``git submodule update --init``).

Only the dense decode path is compiled (its kernel instantiation for bf16, the scheduling-metadata and combine
kernels, and a one-function binding of ``dense_attn_decode_interface``), through torch's extension loader
(ninja, cached in ``build_dir``), so the build takes about a minute instead of the whole package's many.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

BINDING = """
#include "api/dense_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dense_decode_fwd", &dense_attn_decode_interface); }
"""


def load_flashmla(src_dir: str, build_dir: str | None = None, verbose: bool = False):
    """Compile (or load from ``build_dir``) FlashMLA's dense decode; returns the extension module."""
    from torch.utils.cpp_extension import load

    root = Path(src_dir).resolve()
    csrc = root / "csrc"
    need = [csrc / "api" / "dense_decode.h", csrc / "cutlass" / "include" / "cute" / "tensor.hpp"]
    for p in need:
        if not p.exists():
            raise SystemExit(f"--flashmla {src_dir}: {p} is missing (need a FlashMLA checkout with csrc/cutlass)")
    build = Path(build_dir or os.path.join(root, "build_quantmla_bench"))
    build.mkdir(parents=True, exist_ok=True)
    binding = build / "binding.cpp"
    binding.write_text(BINDING)
    sources = [
        str(binding),
        str(csrc / "smxx" / "decode" / "get_decoding_sched_meta" / "get_decoding_sched_meta.cu"),
        str(csrc / "smxx" / "decode" / "combine" / "combine.cu"),
        str(csrc / "sm90" / "decode" / "dense" / "instantiations" / "bf16.cu"),
    ]
    includes = [csrc, csrc / "kerutils" / "include", csrc / "sm90", csrc / "cutlass" / "include",
                csrc / "cutlass" / "tools" / "util" / "include"]  # fmt: skip
    from torch.utils.cpp_extension import CUDA_HOME

    cccl = Path(CUDA_HOME or "/usr/local/cuda") / "include" / "cccl"  # CUDA 13 keeps libcu++ here (g++ needs it)
    if cccl.is_dir():
        includes.append(cccl)
    cuda_flags = [
        "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "--use_fast_math", "-DFLASH_MLA_DISABLE_FP16", "-gencode=arch=compute_90a,code=sm_90a",
    ]  # fmt: skip
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    return load(
        name="flashmla_dense_bench",
        sources=sources,
        extra_cflags=["-O3", "-std=c++20", "-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16"],
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=[str(p) for p in includes],
        build_directory=str(build),
        verbose=verbose,
    )


def load_prebuilt(so_path: str):
    """The extension ``load_flashmla`` built earlier (``<build_dir>/flashmla_dense_bench.so``), loaded as it is: no
    sources, no compiler (2.5 MB to carry instead of the 29 MB checkout). It must come from the same torch build."""
    import importlib.machinery
    import importlib.util

    path = Path(so_path)
    if not path.is_file():
        raise SystemExit(f"--flashmla-prebuilt {so_path}: no such file (build it once with --flashmla DIR)")
    loader = importlib.machinery.ExtensionFileLoader("flashmla_dense_bench", str(path))
    spec = importlib.util.spec_from_file_location("flashmla_dense_bench", str(path), loader=loader)
    try:
        mod = importlib.util.module_from_spec(spec)  # the dlopen happens here for an extension module
        loader.exec_module(mod)
    except ImportError as e:
        raise SystemExit(f"--flashmla-prebuilt {so_path} does not load here ({e}): rebuild it with --flashmla DIR "
                         "on this machine's torch") from e  # fmt: skip
    if not hasattr(mod, "dense_decode_fwd"):
        raise SystemExit(f"--flashmla-prebuilt {so_path} is not the FlashMLA dense-decode extension")
    return mod


class FlashMLADecode:
    """FlashMLA dense decode over a BF16 paged cache ``[num_blocks, 64, 1, 576]`` with our block table; the
    scheduling metadata is computed once (as a serving engine does per batch) and reused."""

    def __init__(self, ext, q: torch.Tensor, kcache: torch.Tensor, lens: torch.Tensor, block_table: torch.Tensor,
                 softmax_scale: float):  # fmt: skip
        self.ext, self.q, self.kcache, self.lens, self.bt, self.scale = ext, q, kcache, lens, block_table, softmax_scale
        out = ext.dense_decode_fwd(q, kcache, 512, lens, block_table, softmax_scale, False, None, None)
        self.meta, self.splits = out[2], out[3]

    def __call__(self):
        return self.ext.dense_decode_fwd(
            self.q, self.kcache, 512, self.lens, self.bt, self.scale, False, self.meta, self.splits
        )
