"""benchmarks/kernel_variants.py: variant sources carry their macros ahead of the kernel, a NAME=DIR variant must
name a kernel source folder, and the table's ratios are the measured times' ratios (to base and to FlashMLA)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernel_variants as kv  # noqa: E402


def test_variant_source_defines_its_macros_first(tmp_path):
    d = kv.make_source("pvbf16", tmp_path)
    text = (d / f"{kv.KERNEL}.cu").read_text()
    assert text.splitlines()[1] == "#define QMLA_SM90_PV_F16 0"
    assert text.index("#define QMLA_SM90_PV_F16 0") < text.index('#include "mla_sm90_cfg.cuh"')
    assert (d / "mla_sm90_cfg.cuh").read_text() == (kv.CSRC / "mla_sm90_cfg.cuh").read_text()
    assert (d / "decode_mla.cu").read_text().splitlines()[1] == "#define QMLA_SM90_PV_F16 0"  # every library


def test_unknown_variant_and_bad_folder_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant"):
        kv.make_source("nope", tmp_path)
    with pytest.raises(SystemExit, match="has no decode_mla_sm90.cu"):
        kv.make_source(f"old={tmp_path / 'empty'}", tmp_path)


def test_table_ratios(tmp_path):
    shape = {"heads": 16, "batch": 8, "context": 131072}
    res = {"base": [{**shape, "impl": "c4r4@wgmma", "us": 200.0}, {**shape, "impl": "flashmla-bf16", "us": 300.0}],
           "qvec": [{**shape, "impl": "c4r4@wgmma", "us": 160.0}]}  # fmt: skip
    kv.write_table(res, {"base": "defaults", "qvec": "q"}, tmp_path, "t", "c4r4@wgmma", "8x131072", "16")
    rows = {r["variant"]: r for r in json.loads((tmp_path / "kernel_variants_t.json").read_text())["rows"]}
    assert rows["qvec"]["vs_base"] == pytest.approx(200.0 / 160.0)
    assert rows["qvec"]["vs_flashmla"] == pytest.approx(300.0 / 160.0)
    assert rows["base"]["vs_flashmla"] == pytest.approx(1.5)
    md = (tmp_path / "kernel_variants_t.md").read_text()
    assert "160.0 (1.25x)" in md and "1.88x" in md


def test_ablations_keep_their_timings_and_skip_nothing_else(tmp_path):
    """An ablation (QMLA_SM90_ABLATE) computes a wrong result on purpose: its timed rows stay in the table even though
    their check failed; any other variant's failed row is left out; a row without a time never stays. Its sources
    carry the mask ahead of the kernel like any variant's."""
    assert kv.is_ablation("abl_unpack") and not kv.is_ablation("base") and not kv.is_ablation("prev=/x")
    rows = [{"impl": "c4r4@wgmma", "us": 120.0, "ok": False}, {"impl": "c4r4t", "us": None, "ok": False},
            {"impl": "c2r4t", "us": 100.0, "ok": True}]  # fmt: skip
    kept, bad = kv.kept_rows("abl_unpack", rows)
    assert kept == [rows[0], rows[2]] and bad == [rows[1]]
    kept, bad = kv.kept_rows("base", rows)
    assert kept == [rows[2]] and bad == rows[:2]
    d = kv.make_source("abl_dram", tmp_path)
    assert (d / f"{kv.KERNEL}.cu").read_text().splitlines()[1] == "#define QMLA_SM90_ABLATE 8"
    masks = {v["QMLA_SM90_ABLATE"] for n, v in kv.VARIANTS.items() if kv.is_ablation(n)}
    assert masks == {1, 2, 3, 4, 8}


def test_the_tests_a_variant_run_takes_follow_the_timed_kernel():
    assert kv.tested_kernel("c4r4@wgmma") == "wgmma"
    assert kv.tested_kernel("c4r4,c2r4") == "wgmma"
    assert kv.tested_kernel("c4r4@hm,c2r4@hm") == "hm"
    assert kv.tested_kernel("c4r4@ws,c4r4") == "ws"
    with pytest.raises(SystemExit, match="one kernel"):
        kv.tested_kernel("c4r4@hm,c4r4@ws")


def test_every_variant_names_macros_a_kernel_source_reads():
    """A variant's macro must be read by some kernel source (a typo would build the default and time it as the
    variant)."""
    texts = "".join(f.read_text() for f in kv.CSRC.iterdir() if f.suffix in (".cu", ".cuh"))
    for name, macros in kv.VARIANTS.items():
        for m in macros:
            assert f"#ifndef {m}" in texts or f"defined({m})" in texts or f"#if {m}" in texts, (name, m)


def test_flashmla_is_built_from_a_checkout_or_loaded_prebuilt_never_both():
    assert kv.flashmla_args(None, None, None) == []
    assert kv.flashmla_args(None, None, ".fmbuild/x.so") == ["--flashmla-prebuilt", ".fmbuild/x.so"]
    assert kv.flashmla_args(".flashmla", None, None) == ["--flashmla", ".flashmla"]
    assert kv.flashmla_args(".flashmla", "/tmp/b", None) == ["--flashmla", ".flashmla", "--flashmla-build", "/tmp/b"]
    with pytest.raises(SystemExit, match="give one"):
        kv.flashmla_args(".flashmla", None, "x.so")
    with pytest.raises(SystemExit, match="give --flashmla too"):
        kv.flashmla_args(None, "/tmp/b", None)
