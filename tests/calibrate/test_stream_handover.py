"""A streamed calibration continued elsewhere: without its bank (recomputed: the identical delta), and from the
packed progress file alone (another directory, as on another machine): the identical transforms file, and the delta
equal to an uninterrupted run's to the fp32 rounding of the transforms."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ckpt_util import save_sharded, tiny_calibration

from quantmla.calibrate.delta import load_delta
from quantmla.calibrate.shipped import load_transforms
from quantmla.calibrate.stream import calibrate_streamed
from quantmla.calibrate.stream_handover import pack_progress, progress_of, unpack_progress
from quantmla.mla.tiny import tiny_model

FMT, CFG, TOKENS = tiny_calibration()


class _Stop(Exception):
    pass


def _stop_after(n):
    def hook(b):
        if b == n - 1:
            raise _Stop

    return hook


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A 3-block checkpoint and its uninterrupted delta + transforms."""
    tmp = tmp_path_factory.mktemp("ref")
    path = save_sharded(tiny_model("deepseek_v3_half", seed=5), tmp / "base")
    delta, tf = tmp / "ref.delta.safetensors", tmp / "ref.tf.safetensors"
    calibrate_streamed(path, FMT, TOKENS, CFG, delta, dtype=torch.float32, transforms_out=tf)
    return path, load_delta(delta)[0], load_transforms(tf)[0]


def _interrupted(path, tmp_path, blocks):
    work = tmp_path / "work"
    with pytest.raises(_Stop):
        calibrate_streamed(path, FMT, TOKENS, CFG, tmp_path / "d.safetensors", work=work, dtype=torch.float32,
                           on_block_done=_stop_after(blocks))  # fmt: skip
    return work


def _resume(path, work, out_dir):
    delta, tf = out_dir / "d.safetensors", out_dir / "t.safetensors"
    calibrate_streamed(path, FMT, TOKENS, CFG, delta, work=work, dtype=torch.float32, resume=True, transforms_out=tf)
    return load_delta(delta)[0], load_transforms(tf)[0]


def test_a_lost_bank_is_recomputed_to_the_identical_delta(reference, tmp_path):
    path, want_delta, want_tf = reference
    assert sum(k.endswith(".rope.post_rotation") for k in want_tf) == 3  # compared below with the rest
    work = _interrupted(path, tmp_path, 2)
    (work / "bank.pt").unlink()
    got_delta, got_tf = _resume(path, work, tmp_path)
    assert set(got_delta) == set(want_delta) and all(torch.equal(got_delta[k], want_delta[k]) for k in want_delta)
    assert set(got_tf) == set(want_tf) and all(torch.equal(got_tf[k], want_tf[k]) for k in want_tf)


@pytest.mark.parametrize("blocks", [1, 2])
def test_packed_progress_continues_in_another_directory(reference, tmp_path, blocks):
    path, want_delta, want_tf = reference
    work = _interrupted(path, tmp_path / "machine_a", blocks)
    packed = pack_progress(work, tmp_path / "carry" / "progress.safetensors")
    full = sum(p.stat().st_size for p in work.iterdir())
    assert packed.stat().st_size < full / 3  # the bank and the folded tensors stay behind
    assert progress_of(packed)["blocks_done"] == blocks
    shutil.rmtree(tmp_path / "machine_a")  # the first machine is gone

    work_b = tmp_path / "machine_b" / "work"
    assert unpack_progress(packed, work_b) == blocks
    assert not (work_b / "bank.pt").exists()
    with pytest.raises(FileExistsError, match="exists"):
        unpack_progress(packed, work_b)
    got_delta, got_tf = _resume(path, work_b, tmp_path / "machine_b")
    # the transforms were learned before the hand-over or after it from the same hidden states: identical
    assert set(got_tf) == set(want_tf) and all(torch.equal(got_tf[k], want_tf[k]) for k in want_tf)
    # the finished blocks' folded tensors come from the fp32-stored transforms again
    assert set(got_delta) == set(want_delta)
    for k in want_delta:
        torch.testing.assert_close(got_delta[k], want_delta[k], rtol=1e-5, atol=1e-6)
    assert not work_b.exists()  # finished: the work directory is removed as usual


def test_packed_progress_of_another_run_is_refused(reference, tmp_path):
    path, _, _ = reference
    work = _interrupted(path, tmp_path / "a", 1)
    packed = pack_progress(work, tmp_path / "p.safetensors")
    work_b = tmp_path / "b"
    unpack_progress(packed, work_b)
    other = torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="another run"):
        calibrate_streamed(path, FMT, other, CFG, tmp_path / "o.safetensors", work=work_b, dtype=torch.float32,
                           resume=True)  # fmt: skip
    with pytest.raises(FileExistsError, match="force"):
        pack_progress(work, packed)
    with pytest.raises(ValueError, match="not a quantmla packed calibration progress"):
        unpack_progress(work / "block_00000.safetensors", tmp_path / "c")
    with pytest.raises(RuntimeError, match="progress.json"):
        pack_progress(tmp_path, tmp_path / "q.safetensors")
    assert json.loads((work_b / "progress.json").read_text())["blocks_done"] == 1
