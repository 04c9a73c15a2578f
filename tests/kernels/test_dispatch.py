"""Dispatch rules, overrides and the lazy import of Triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from quantmla.kernels.dispatch import ENV_VAR, force_impl, resolve_impl, triton_unsupported_reason
from quantmla.quant.formats import get_format


def test_import_does_not_load_triton_or_cuda():
    code = (
        "import sys, quantmla, quantmla.kernels; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "import torch; assert not torch.cuda.is_initialized(), 'cuda initialized'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_on_cpu_is_torch_and_overrides(monkeypatch):
    x = torch.zeros(1)
    fmt = get_format("c4r4")
    monkeypatch.delenv(ENV_VAR, raising=False)
    if not torch.cuda.is_available():
        assert resolve_impl("auto", x, fmt, kernel="decode") == "torch"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert resolve_impl("auto", x, fmt, kernel="decode") == "torch"
    with force_impl("torch"):
        assert resolve_impl("auto", x, fmt, kernel="decode") == "torch"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_impl("auto", x, fmt, kernel="decode")
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("fast", x, fmt, kernel="decode")


def test_unsupported_formats_say_why():
    assert triton_unsupported_reason(get_format("c4r4"), 512, 64, 64, "decode") == ""
    assert "both paths" in triton_unsupported_reason(get_format("c4r16"), 512, 64, 64, "decode")
    assert "RoPE bits" in triton_unsupported_reason(get_format("c4r2"), 512, 64, 64, "decode")
    with pytest.raises(ValueError, match="cannot run decode"):
        resolve_impl("triton", torch.zeros(1), get_format("c4r16"), kernel="decode")



def test_two_group_rope_is_offered_to_triton():
    """4-bit RoPE in two groups (SmolLM2-MLA variant a: 128-dim RoPE, groups of 64): plain planar pages, one group
    per bit plane, so the Triton decode kernel takes it (its result: test_decode.py); a group narrower than a
    plane is refused."""
    from dataclasses import replace

    assert triton_unsupported_reason(get_format("c4r4"), 256, 128, 64, "decode") == ""
    fmt = get_format("c4r4")
    narrow = replace(fmt, rope=replace(fmt.rope, group_size=32))
    assert "rope_dim / 2" in triton_unsupported_reason(narrow, 256, 128, 64, "decode")
    assert triton_unsupported_reason(get_format("c8r8"), 256, 128, 64, "decode") == ""  # 8 bit: two halves
