"""``benchmarks/bench_decode.py`` off the GPU: its format specs (``FORMAT[@KERNEL][/sN]``) parse or fail with a clear
message, and its report files are whole (temp file + rename) with each cell's speed-up over FlashMLA in the same
row's shape."""

from __future__ import annotations

import json

import pytest

from benchutil import load_benchmark

bd = load_benchmark("bench_decode")


def test_format_specs():
    assert bd.parse_spec("c4r4") == ("c4r4", "", None)
    assert bd.parse_spec("c4r4@wgmma") == ("c4r4", "wgmma", None)
    assert bd.parse_spec("bf16/s34") == ("bf16", "", 34)
    assert bd.parse_spec("c8r8@wgmma/s7") == ("c8r8", "wgmma", 7)
    assert bd.parse_spec("c4r4/equal") == ("c4r4", "", "equal")
    for bad in ("bf16/34", "bf16/s0", "bf16/s", "bf16/sx", "@wgmma", "/s4"):
        with pytest.raises(ValueError, match="format spec"):
            bd.parse_spec(bad)


def test_ragged_lengths_spread_from_an_eighth_to_the_context():
    lens = bd.ragged_lengths(32, 32768)
    assert len(lens) == 32 and lens[0] == 4096 and lens[-1] == 32768 and lens == sorted(lens)
    assert len(set(b - a for a, b in zip(lens, lens[1:]))) <= 2  # evenly spread (up to rounding)
    assert bd.ragged_lengths(1, 1000) == [1000]


def test_report_cells_and_no_half_files(tmp_path):
    meta = {"device": "test", "date": "2026-12-02", "commit": "abc", "command": "x", "reps": 3, "copy_gbps": 4000.0}
    rows = [{"batch": 32, "context": 4096, "heads": 16, "impl": "flashmla-bf16", "us": 60.0, "ok": True},
            {"batch": 32, "context": 4096, "heads": 16, "impl": "bf16/s17", "us": 75.0, "ok": True},
            {"batch": 32, "context": 4096, "heads": 16, "impl": "bf16/s34", "us": 48.0, "ok": False}]  # fmt: skip
    bd.write_outputs(str(tmp_path), "t", meta, rows, plot=False)
    assert json.loads((tmp_path / "decode_vs_flashmla_t.json").read_text())["rows"] == rows
    md = (tmp_path / "decode_vs_flashmla_t.md").read_text()
    assert "| bf16/s17 | bf16/s34 |" in md
    assert f"75.0 ({60 / 75:.2f}x)" in md and f"48.0 ({60 / 48:.2f}x) CHECK FAIL" in md
    assert not list(tmp_path.glob("*.tmp*"))


def test_rounds_report_the_median_and_the_per_round_ratios(tmp_path):
    """--rounds: each row's time is the median of its rounds; each speed-up is taken round by round (FlashMLA and the
    format of the same round) and reported as the median with its range."""
    rows = [{"batch": 8, "context": 131072, "heads": 16, "impl": "flashmla-bf16", "us_rounds": [330.0, 310.0, 312.0],
             "ok": True},
            {"batch": 8, "context": 131072, "heads": 16, "impl": "c8r8", "us_rounds": [200.0, 210.0, 208.0],
             "ok": True}]  # fmt: skip
    bd.summarize_rounds(rows)
    assert rows[0]["us"] == 312.0 and rows[1]["us"] == 208.0 and "ratio_rounds" not in rows[0]
    want = [330 / 200, 310 / 210, 312 / 208]
    assert rows[1]["ratio_rounds"] == pytest.approx(want, rel=1e-12)
    meta = {"device": "test", "date": "2026-12-03", "commit": "abc", "command": "x", "reps": 3, "copy_gbps": 4e3,
            "rounds": 3}  # fmt: skip
    bd.write_outputs(str(tmp_path), "r", meta, rows, plot=False)
    md = (tmp_path / "decode_vs_flashmla_r.md").read_text()
    med = sorted(want)[1]
    assert f"208.0 ({med:.2f}x, {min(want):.2f}-{max(want):.2f})" in md and "3 rounds round-robin" in md
    with pytest.raises(ValueError):  # rounds of unequal length are a bug, not a shorter ratio list
        bd.summarize_rounds([dict(rows[0], us_rounds=[1.0, 2.0, 3.0]), dict(rows[1], us_rounds=[1.0, 2.0])])


def test_cells_name_the_kernel_where_auto_changed_it(tmp_path):
    """A format that ``auto`` ran on different CUDA kernels at different shapes (the H200 took mma past 2^21 units of
    work until 2026-12-05) has each cell marked with its kernel; a format on one kernel everywhere, and a failed row,
    are left unmarked."""
    meta = {"device": "test", "date": "2026-12-04", "commit": "abc", "command": "x", "reps": 3, "copy_gbps": 4e3}
    base = {"heads": 16, "ok": True}
    rows = [dict(base, batch=32, context=32768, impl="flashmla-bf16", us=320.0),
            dict(base, batch=32, context=131072, impl="flashmla-bf16", us=1120.0),
            dict(base, batch=32, context=32768, impl="c4r4", us=190.0, kernel="cuda-wgmma"),
            dict(base, batch=32, context=131072, impl="c4r4", us=745.0, kernel="cuda-mma"),
            dict(base, batch=32, context=32768, impl="c4r4t", us=169.0, kernel="cuda-wgmma"),
            dict(base, batch=32, context=131072, impl="c4r4t", us=588.0, kernel="cuda-wgmma"),
            dict(base, batch=32, context=32768, impl="c8r8", us=None, kernel="cuda-mma", error="x"),
            dict(base, batch=32, context=131072, impl="c8r8", us=760.0, kernel="cuda-wgmma")]
    marks = bd.kernel_marks(rows)
    assert sorted(marks.values()) == [" [mma]", " [wgmma]"]
    bd.write_outputs(str(tmp_path), "k", meta, rows, plot=False)
    md = (tmp_path / "decode_vs_flashmla_k.md").read_text()
    assert f"190.0 ({320 / 190:.2f}x) [wgmma]" in md and f"745.0 ({1120 / 745:.2f}x) [mma]" in md
    assert f"588.0 ({1120 / 588:.2f}x) |" in md and f"760.0 ({1120 / 760:.2f}x) |" in md


def test_triton_rows_record_the_split_plan_the_kernel_launches():
    """A Triton row's ``plan`` is the launch's (splits x pages per split): for a ragged BF16 batch the plan for its own
    lengths (split_plan: 11 x 4 on the CPU's 8 "SMs", 2 programs each), a forced count as given."""
    import torch

    from quantmla.kernels.paged import PagedMLACache
    from quantmla.kernels.split_plan import split_plan
    from quantmla.quant.formats import CachePolicy

    lens = [700, 60, 30]
    cache = PagedMLACache("bf16", 3, 700, policy=CachePolicy(sink=4, local=16, page_size=16))
    cache.write_reference(torch.zeros(3, 700, 512), torch.zeros(3, 700, 64), lens)
    q = torch.zeros(3, 2, 512)
    ns = split_plan((2, 4, 44), 1, 16)
    assert bd.cuda_plan("triton", q, q, cache, None) == {"plan": f"{ns} x {-(-44 // ns)}"} == {"plan": "11 x 4"}
    assert bd.cuda_plan("triton", q, q, cache, 2) == {"plan": "2 x 22"}
    assert bd.cuda_plan("torch", q, q, cache, None) == {}


def test_a_tag_naming_another_gpu_is_said_in_the_report(tmp_path):
    """A tag is a file name: "h200_x" written on an H100 would pass for an H200 result, so the report says so."""
    assert bd.tag_device_mismatch("h200_hm_next", "NVIDIA H100 80GB HBM3") == (
        "the tag names H200 but this ran on NVIDIA H100 80GB HBM3")
    assert bd.tag_device_mismatch("h100_hm_s37", "NVIDIA H100 80GB HBM3") == ""
    assert bd.tag_device_mismatch("variant_s37b_base", "NVIDIA H200") == ""  # no GPU model named
    assert bd.tag_device_mismatch("h200", "NVIDIA H200") == ""
    assert bd.tag_device_mismatch("x_h1000", "NVIDIA H200") == ""  # not a model name
    assert bd.gpu_models("NVIDIA H100 80GB HBM3") == ["h100"]  # (the default tag; "hbm3" is not a model)
    meta = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-06", "commit": "abc", "command": "x", "reps": 3,
            "copy_gbps": 3000.0, "tag_note": bd.tag_device_mismatch("h200_t", "NVIDIA H100 80GB HBM3")}
    rows = [{"batch": 8, "context": 4096, "heads": 64, "impl": "flashmla-bf16", "us": 60.0, "ok": True}]
    bd.write_outputs(str(tmp_path), "h200_t", meta, rows, plot=False)
    md = (tmp_path / "decode_vs_flashmla_h200_t.md").read_text()
    assert "Note: the tag names H200 but this ran on NVIDIA H100" in md
