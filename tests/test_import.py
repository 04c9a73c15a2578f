"""`import quantmla` must work without a GPU and must not initialize CUDA or import triton."""

import subprocess
import sys


def test_import_does_not_touch_cuda_or_triton():
    code = (
        "import sys, torch, quantmla, quantmla.cache.hf, quantmla.quant.formats, quantmla.mla.spec\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialized by import quantmla'\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
