"""Artifact folders: published whole or not at all, never replaced without force, never trusted when incomplete;
double runs and interrupts at every step of the swap leave a consistent destination."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quantmla import artifacts as art


def _write(folder, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = os.path.join(folder, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as fh:
            fh.write(text)


def _read_all(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            if f != art.MANIFEST:
                out[os.path.relpath(p, folder)] = open(p).read()
    return out


def _siblings(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def test_publish_writes_manifest_last_and_leaves_no_temp(tmp_path):
    final = str(tmp_path / "a")
    with art.staged(final, key={"k": 1}) as tmp:
        _write(tmp, {"w.bin": "weights", "sub/t.json": "{}"})
        assert not os.path.exists(final)  # nothing at the destination until the end
    assert _read_all(final) == {"w.bin": "weights", os.path.join("sub", "t.json"): "{}"}
    m = art.read_manifest(final)
    assert m["key"] == {"k": 1} and m["files"] == {"w.bin": 7, os.path.join("sub", "t.json"): 2}
    assert _siblings(tmp_path) == ["a"]


def test_a_failure_or_interrupt_while_writing_leaves_the_destination_as_it_was(tmp_path):
    final = str(tmp_path / "a")
    for exc in (OSError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with art.staged(final) as tmp:
                _write(tmp, {"half.bin": "x"})
                raise exc
        assert _siblings(tmp_path) == []
    with art.staged(final) as tmp:
        _write(tmp, {"w.bin": "old"})
    with pytest.raises(RuntimeError):
        with art.staged(final, force=True) as tmp:
            _write(tmp, {"w.bin": "new"})
            raise RuntimeError("killed")
    assert _read_all(final) == {"w.bin": "old"} and _siblings(tmp_path) == ["a"]


def test_existing_destination_is_refused_without_force(tmp_path):
    final = tmp_path / "a"
    final.mkdir()
    (final / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="force"):
        with art.staged(str(final)) as tmp:
            _write(tmp, {"w.bin": "x"})
    assert (final / "mine.txt").read_text() == "user data" and _siblings(tmp_path) == ["a"]


def test_double_run_the_second_publish_is_refused_and_the_first_kept(tmp_path):
    """Two runs check the destination before working (both see nothing), then publish: the later one must fail
    instead of replacing the first one's result (the no-replace rename, not the early check, decides)."""
    final = str(tmp_path / "a")
    with pytest.raises(FileExistsError, match="appeared while this job ran"):
        with art.staged(final) as tmp_outer:
            _write(tmp_outer, {"w.bin": "second"})
            with art.staged(final) as tmp_inner:  # another run finishes while this one is still writing
                _write(tmp_inner, {"w.bin": "first"})
    assert _read_all(final) == {"w.bin": "first"} and art.read_manifest(final) is not None
    assert _siblings(tmp_path) == ["a"]


def test_double_run_refused_even_when_the_early_check_is_bypassed(tmp_path, monkeypatch):
    final = str(tmp_path / "a")
    with art.staged(final) as tmp:
        _write(tmp, {"w.bin": "first"})
    tmp2 = str(tmp_path / "b")
    os.mkdir(tmp2)
    _write(tmp2, {"w.bin": "second"})
    monkeypatch.setattr(art, "check_destination", lambda final, force, late=False: None)  # a race: nothing seen
    with pytest.raises(FileExistsError):
        art.publish(tmp2, final, force=False)
    assert _read_all(final) == {"w.bin": "first"}


@pytest.mark.parametrize("exc", [OSError("EIO"), KeyboardInterrupt()])
def test_force_swap_interrupted_puts_the_old_folder_back(tmp_path, monkeypatch, exc):
    final = str(tmp_path / "a")
    with art.staged(final, key={"v": "old"}) as tmp:
        _write(tmp, {"w.bin": "old"})
    real = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".a.tmp-") and dst == final:
            raise exc  # the swap itself fails, after the old folder was set aside
        return real(src, dst)

    monkeypatch.setattr(art.os, "rename", rename)
    with pytest.raises(type(exc)):
        with art.staged(final, force=True, key={"v": "new"}) as tmp:
            _write(tmp, {"w.bin": "new"})
    monkeypatch.setattr(art.os, "rename", real)
    assert _read_all(final) == {"w.bin": "old"} and art.read_manifest(final)["key"] == {"v": "old"}
    assert _siblings(tmp_path) == ["a"]


def test_force_replaces_old_folder_and_cleans_up(tmp_path):
    final = tmp_path / "a"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with art.staged(str(final), force=True) as tmp:
        _write(tmp, {"w.bin": "new"})
    assert _read_all(str(final)) == {"w.bin": "new"} and _siblings(tmp_path) == ["a"]
    (tmp_path / "f").write_text("a file")
    with art.staged(str(tmp_path / "f"), force=True) as tmp:  # a file in the way is replaced too, with force
        _write(tmp, {"w.bin": "x"})
    assert os.path.isdir(tmp_path / "f")


def test_incomplete_or_truncated_folders_are_not_complete(tmp_path):
    final = str(tmp_path / "a")
    with art.staged(final) as tmp:
        _write(tmp, {"w.bin": "0123456789", "c.json": "{}"})
    assert art.read_manifest(final) is not None
    with open(os.path.join(final, "w.bin"), "w") as fh:
        fh.write("01234")  # truncated
    assert art.read_manifest(final) is None
    with open(os.path.join(final, "w.bin"), "w") as fh:
        fh.write("0123456789")
    os.remove(os.path.join(final, "c.json"))  # missing
    assert art.read_manifest(final) is None
    with open(os.path.join(final, art.MANIFEST), "w") as fh:
        fh.write("{not json")
    assert art.read_manifest(final) is None
    assert art.read_manifest(str(tmp_path / "nothing")) is None


def test_stale_temp_folders_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".a.tmp-{art._host()}-{dead.pid}-xyz"
    stale.mkdir()
    (stale / "half.bin").write_text("x")
    aside = tmp_path / f".a.old-{art._host()}-{dead.pid}-abc"
    aside.mkdir()
    mine = tmp_path / f".a.tmp-{art._host()}-{os.getpid()}-live"  # a live writer's folder is left alone
    mine.mkdir()
    other_host = tmp_path / f".a.tmp-otherhost-{dead.pid}-q"
    other_host.mkdir()
    with art.staged(str(tmp_path / "a")) as tmp:
        _write(tmp, {"w.bin": "x"})
    assert _siblings(tmp_path) == sorted(["a", mine.name, other_host.name])


# ---- model folders --------------------------------------------------------------------------------------------


class _Model:
    def __init__(self, text="weights", fail=False):
        self.text, self.fail = text, fail

    def save_pretrained(self, path):
        with open(os.path.join(path, "model.safetensors"), "w") as fh:
            fh.write(self.text)
        if self.fail:
            raise OSError("disk full")


KEY_A = {"kind": "conversion", "source": "s", "config": {"variant": "a", "rope_dim": None}}
KEY_B = {"kind": "conversion", "source": "s", "config": {"variant": "b", "rope_dim": None}}


def test_model_dir_reused_only_for_the_same_key(tmp_path):
    final = str(tmp_path / "m")
    assert art.reusable_model_dir(final, KEY_A, force=False) is False  # nothing there: build
    art.save_model_dir(final, _Model("a"), None, {"x": 1}, key=KEY_A)
    assert art.reusable_model_dir(final, KEY_A, force=False) is True
    assert art.reusable_model_dir(final, json.loads(json.dumps(KEY_A)), force=False) is True
    with pytest.raises(FileExistsError, match=r"config\.variant: 'a' there, 'b' asked"):
        art.reusable_model_dir(final, KEY_B, force=False)
    assert art.reusable_model_dir(final, KEY_B, force=True) is False
    with pytest.raises(FileExistsError):
        art.save_model_dir(final, _Model("b"), None, {"x": 2}, key=KEY_B)  # no force: refused
    art.save_model_dir(final, _Model("b"), None, {"x": 2}, key=KEY_B, force=True)
    assert art.reusable_model_dir(final, KEY_B, force=False) is True
    with open(os.path.join(final, art.MARKER)) as fh:
        assert json.load(fh) == {"x": 2}


def test_model_dir_incomplete_is_never_reused(tmp_path):
    final = str(tmp_path / "m")
    art.save_model_dir(final, _Model(), None, {"x": 1}, key=KEY_A)
    os.remove(os.path.join(final, "model.safetensors"))  # a marker without weights (the old force bug's state)
    with pytest.raises(FileExistsError, match="incomplete"):
        art.reusable_model_dir(final, KEY_A, force=False)
    assert art.reusable_model_dir(final, KEY_A, force=False, rebuild_incomplete=True) is False
    legacy = tmp_path / "legacy"  # a marker but no manifest (written by an older quantmla, or half copied)
    legacy.mkdir()
    (legacy / art.MARKER).write_text("{}")
    with pytest.raises(FileExistsError, match="incomplete"):
        art.reusable_model_dir(str(legacy), KEY_A, force=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with pytest.raises(FileExistsError, match="not a quantmla model folder"):
        art.reusable_model_dir(str(foreign), KEY_A, force=False)


def test_model_dir_failed_save_leaves_nothing(tmp_path):
    final = str(tmp_path / "models" / "m")
    with pytest.raises(OSError, match="disk full"):
        art.save_model_dir(final, _Model(fail=True), None, {"x": 1}, key=KEY_A)
    assert os.listdir(tmp_path / "models") == []


def test_model_dir_concurrent_build_of_the_same_key_is_accepted(tmp_path):
    final = str(tmp_path / "m")

    class Racing(_Model):
        def save_pretrained(self, path):
            super().save_pretrained(path)
            art.save_model_dir(final, _Model("theirs"), None, {"who": "them"}, key=KEY_A)

    assert art.save_model_dir(final, Racing("ours"), None, {"who": "us"}, key=KEY_A) == final
    assert open(os.path.join(final, "model.safetensors")).read() == "theirs"
    assert art.read_manifest(final) is not None and os.listdir(tmp_path) == ["m"]

    class RacingOther(_Model):
        def save_pretrained(self, path):
            super().save_pretrained(path)
            art.save_model_dir(final + "2", _Model("theirs"), None, {}, key=KEY_B)

    with pytest.raises(FileExistsError):
        art.save_model_dir(final + "2", RacingOther("ours"), None, {}, key=KEY_A)
