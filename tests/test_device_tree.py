"""benchmarks/device_tree.sh: the shipped transforms files leave the working tree for a device call and come back
bit for bit; what is kept stays; a second hide and a restore over a rewritten file are refused. Run on a copy of
the script in a scratch git repo (never this checkout's files)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_tree.sh"
NAMES = ("a-c4r4.safetensors", "a-c2r4.safetensors", "b-heal.safetensors")


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None or shutil.which("sha256sum") is None:
        pytest.skip("needs git and sha256sum")
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "device_tree.sh")
    data = tmp_path / "src" / "quantmla" / "models" / "data"
    data.mkdir(parents=True)
    for i, n in enumerate(NAMES):
        (data / n).write_bytes(bytes(range(256)) * (50 + i) + n.encode())
    (tmp_path / ".gitignore").write_text("/.device_hidden/\n")
    for c in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", *c], cwd=tmp_path, check=True)
    return tmp_path, data


def _run(root, *args):
    return subprocess.run(["bash", "benchmarks/device_tree.sh", *args], cwd=root, capture_output=True, text=True)


def test_hide_keeps_the_named_file_and_restore_brings_the_rest_back_bit_for_bit(repo):
    root, data = repo
    before = {n: (data / n).read_bytes() for n in NAMES}
    r = _run(root, "hide", "a-c4r4.safetensors")
    assert r.returncode == 0, r.stderr
    assert (data / "a-c4r4.safetensors").read_bytes() == before["a-c4r4.safetensors"]
    for n in NAMES[1:]:
        assert (data / n).stat().st_size == 0
        assert (root / ".device_hidden" / n).read_bytes() == before[n]
    status = subprocess.run(["git", "status", "--short"], cwd=root, capture_output=True, text=True).stdout
    assert sorted(line.split("/")[-1] for line in status.splitlines()) == sorted(NAMES[1:])  # hidden dir ignored
    assert "hidden: a-c2r4.safetensors" in _run(root, "status").stdout
    again = _run(root, "hide")
    assert again.returncode == 1 and "restore" in again.stderr
    r = _run(root, "restore")
    assert r.returncode == 0, r.stderr
    assert {n: (data / n).read_bytes() for n in NAMES} == before
    assert subprocess.run(["git", "status", "--short"], cwd=root, capture_output=True, text=True).stdout == ""
    assert not (root / ".device_hidden").exists()


def test_restore_refuses_to_overwrite_a_file_written_since_hide(repo):
    root, data = repo
    assert _run(root, "hide").returncode == 0
    (data / "b-heal.safetensors").write_bytes(b"new")
    r = _run(root, "restore")
    assert r.returncode == 1 and "not empty" in r.stderr
    assert (data / "b-heal.safetensors").read_bytes() == b"new"
    assert (root / ".device_hidden" / "b-heal.safetensors").exists()


def test_hide_refuses_an_unknown_name(repo):
    root, data = repo
    r = _run(root, "hide", "nope.safetensors")
    assert r.returncode == 1 and "no shipped file" in r.stderr
    assert all((data / n).stat().st_size > 0 for n in NAMES)
