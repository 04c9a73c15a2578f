"""benchmarks/results_io.py: results are never overwritten without --force, and land whole or not at all."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import results_io  # noqa: E402


def test_existing_results_need_force(tmp_path):
    stem = results_io.result_stem(str(tmp_path), "x", "t", force=False)
    results_io.write_results(stem, {".json": "{}", ".md": "# x\n"})
    assert (tmp_path / "x_t.md").read_text() == "# x\n" and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit, match="x_t.json/.md exist; pass --force"):
        results_io.result_stem(str(tmp_path), "x", "t", force=False)
    assert results_io.result_stem(str(tmp_path), "x", "t", force=True) == str(tmp_path / "x_t")


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    stem = str(tmp_path / "y_t")
    results_io.write_results(stem, {".md": "old\n"})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results_io.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        results_io.write_results(stem, {".md": "new\n"})
    assert (tmp_path / "y_t.md").read_text() == "old\n"


@pytest.mark.parametrize(("available", "name", "tag"), [
    (True, "NVIDIA H100 80GB HBM3", "h100"),
    (True, "NVIDIA H200", "h200"),
    (True, "NVIDIA RTX 6000 Ada Generation", "gpu"),  # no model name of that form: a tag that claims none
    (False, None, "cpu"),
])  # fmt: skip
def test_the_default_tag_names_the_card_that_ran(monkeypatch, available, name, tag):
    """A result file written without --tag is named for the GPU that made it (an H100's file was once named h200)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert results_io.gpu_tag() == tag
