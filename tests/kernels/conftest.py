"""Kernel tests run Triton through its CPU interpreter when no CUDA device is present.

``TRITON_INTERPRET`` must be set before the Triton kernels are defined; quantmla imports them lazily, on first
use, so setting it here (at collection of this directory) is early enough. Shapes stay small: the interpreter
is slow.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
