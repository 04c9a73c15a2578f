"""Output-path checks shared by the commands (they run before any work)."""

from __future__ import annotations

import pytest

from quantmla.cli_support import UsageError, check_output, usage_errors


def test_check_output_cases(tmp_path):
    f = tmp_path / "f.json"
    check_output(f)  # free
    f.write_text("x")
    with pytest.raises(UsageError, match="exists; pass --force"):
        check_output(f)
    check_output(f, force=True)
    with pytest.raises(UsageError, match="is a file; give a folder path"):
        check_output(f, kind="dir", force=True)
    with pytest.raises(UsageError, match="is a folder; give a file path"):
        check_output(tmp_path, force=True)
    with pytest.raises(UsageError, match="is a file, not a folder"):
        check_output(f / "deeper" / "out.json")
    check_output(tmp_path / "new" / "deeper" / "out", kind="dir")  # missing parents are created later
    assert not (tmp_path / "new").exists()  # the check creates nothing
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="exists; pass --force"):
        check_output(tmp_path / "empty", kind="dir")  # as the artifact writer: any existing folder
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    check_output(tmp_path / "m", kind="dir", may_exist=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "f.json", "m"]  # no probe files left


def test_usage_errors_converts_argument_errors_only():
    with pytest.raises(UsageError, match="^--x: bad value$"):
        with usage_errors("--x: "):
            raise ValueError("bad value")
    with pytest.raises(RuntimeError):
        with usage_errors():
            raise RuntimeError("a failure while working is not a usage error")
