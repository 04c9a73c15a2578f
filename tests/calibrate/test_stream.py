"""Streamed calibration: block by block from the shards (plain and FP8 block-scaled) gives, bit for bit, the tensors
the in-memory calibration of the same model changes, and the merged folder the rounding file (query moments,
post-RoPE rotations) `quantmla calibrate` writes; the delta applies in memory and merges into a checkpoint that
transformers loads; an interrupted run resumes to the identical delta; mismatched bases are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from ckpt_util import fp8_checkpoint, save_sharded, tiny_calibration, tiny_tokens
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from quantmla.calibrate import stream as stream_mod
from quantmla.calibrate.checkpoint import CheckpointError, load_full_model
from quantmla.calibrate.delta import apply_delta, load_delta, load_delta_rounding, merge_checkpoint
from quantmla.calibrate.stream import calibrate_streamed
from quantmla.calibrate.trainer import calibrate_model
from quantmla.mla.tiny import tiny_model

FMT, CFG, _ = tiny_calibration()



def _in_memory(model):
    calibrate_model(model, FMT, tiny_tokens(), CFG)
    return model.state_dict()


def _calibrate_command(model, path, out, monkeypatch):
    """`quantmla calibrate` on ``model`` (calibrated in place) with the shared format, config and tokens: the
    in-memory path, fused folder and rounding file included."""
    import argparse

    import quantmla.quant.formats as formats
    from quantmla.calibrate import cli

    monkeypatch.setattr(cli, "load_model", lambda d, dtype: (model, None))
    monkeypatch.setattr(cli, "calibration_tokens", lambda tok, cfg, corpus: tiny_tokens())
    monkeypatch.setattr(formats, "get_format", lambda name: FMT)
    cfg = out.with_name("cfg.json")
    cfg.write_text(json.dumps(CFG.to_dict()))
    parser = argparse.ArgumentParser()
    cli.add_calibrate_args(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--model", str(path), "--out", str(out), "--config", str(cfg)])
    assert args.func(args) == 0
    return model.state_dict()


def _rounding_file(folder):
    from quantmla.calibrate.delta import ROUNDING_FILE, ROUNDING_KIND, ROUNDING_VERSION, load_tagged

    return load_tagged(folder / ROUNDING_FILE, kind=ROUNDING_KIND, version=ROUNDING_VERSION, what="rounding file")


def _assert_delta_matches(delta, fused, base):
    assert delta, "empty delta"
    for k, t in delta.items():
        assert torch.equal(t, fused[k]), k
    changed = {k for k in fused if not torch.equal(fused[k], base[k])}
    assert changed and changed <= set(delta)  # every tensor calibration changed is in the delta
    assert all("self_attn" in k for k in delta)  # and nothing outside the attention's folded projections


@pytest.mark.parametrize("family", ["deepseek_v2", "longcat_flash"])
def test_streamed_equals_in_memory_on_a_sharded_checkpoint(family, tmp_path, monkeypatch):
    path = save_sharded(tiny_model(family, seed=2), tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    fused = _calibrate_command(base, path, tmp_path / "fused", monkeypatch)
    out = tmp_path / "delta.safetensors"
    rep = calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, dtype=torch.float32)
    delta, meta = load_delta(out)
    _assert_delta_matches(delta, fused, base_state)
    assert len(rep.blocks) == len(meta["report"]) // (2 if family == "longcat_flash" else 1)
    assert meta["recipe"]["cache_format"]["name"] == "c2r4-tiny" and meta["base_key"].startswith("base-")
    assert not (tmp_path / "delta.safetensors.work").exists()  # the progress directory is removed at the end
    # the in-memory loader and the merged checkpoint reproduce the calibrated model
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_delta(fresh, delta)
    merged = merge_checkpoint(path, out, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    for k in fused:
        assert torch.equal(fresh.state_dict()[k], fused[k]) and torch.equal(loaded[k], fused[k]), k
    # the merged folder's rounding file is the fused folder's, bit for bit: the same post-RoPE rotations, and the
    # same query moments (both measured on the calibration inputs each folded layer was calibrated on)
    (want, want_meta), (got, got_meta) = _rounding_file(tmp_path / "fused"), _rounding_file(merged)
    n_layers = len(meta["report"])
    assert set(got) == set(want) and sum(k.endswith(".rope.post_rotation") for k in want) == n_layers
    assert sum(k.endswith(".rope.query_moment") for k in want) == n_layers
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got_meta["rotation"] == want_meta["rotation"] and got_meta["rotation"]["kind"] == "hadamard"
    assert got_meta["method"] == want_meta["method"] == "quantmla"
    qc = json.loads((tmp_path / "fused" / "quantmla.json").read_text())
    assert meta["rope_rounding"] == qc["rope_rounding"] == rep.rope_rounding
    assert json.loads((merged / "quantmla_delta.json").read_text())["rope_rounding"] == qc["rope_rounding"]
    with pytest.raises(FileExistsError, match="force"):
        merge_checkpoint(path, out, merged)
    with pytest.raises(FileExistsError, match="force"):
        calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, dtype=torch.float32)


def test_streamed_fp8_block_checkpoint_equals_in_memory_dequantized(tmp_path):
    src = save_sharded(tiny_model("deepseek_v3", seed=4), tmp_path / "bf")
    fp8, deq = fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", block=(32, 32))
    base = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()  # transformers' loader
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    fused = _in_memory(base)
    out = tmp_path / "delta.safetensors"
    calibrate_streamed(fp8, FMT, tiny_tokens(), CFG, out, dtype=torch.float32)
    delta, meta = load_delta(out)
    _assert_delta_matches(delta, fused, base_state)
    merged = merge_checkpoint(fp8, out, tmp_path / "merged")
    with open(merged / "config.json") as f:
        q = json.load(f)["quantization_config"]
    with open(merged / "model.safetensors.index.json") as f:
        wmap = json.load(f)["weight_map"]
    for k in delta:  # the folded weight is stored unquantized, its block scales dropped, its module not converted
        assert k + "_scale_inv" not in wmap
        if k.endswith("proj.weight"):
            assert k.rsplit(".", 1)[0] in q["modules_to_not_convert"]
    assert any(k.endswith("experts.0.gate_proj.weight_scale_inv") for k in wmap)  # the rest stays FP8
    loaded = load_full_model(merged, torch.float32).state_dict()
    for k in fused:
        assert torch.equal(loaded[k], fused[k]), k


class _Stop(Exception):
    pass


def test_interrupted_run_resumes_to_the_identical_delta(tmp_path, monkeypatch):
    path = save_sharded(tiny_model("deepseek_v3_half", seed=5), tmp_path / "base")  # 3 blocks
    ref = tmp_path / "ref.safetensors"
    calibrate_streamed(path, FMT, tiny_tokens(), CFG, ref, dtype=torch.float32)
    out, work = tmp_path / "delta.safetensors", tmp_path / "work"

    def stop_after_first(b):
        if b == 0:
            raise _Stop

    with pytest.raises(_Stop):
        calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, work=work, dtype=torch.float32,
                           on_block_done=stop_after_first)  # fmt: skip
    assert not out.exists()
    with open(work / "progress.json") as f:
        assert json.load(f)["blocks_done"] == 1
    with pytest.raises(FileExistsError, match="--resume"):
        calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, work=work, dtype=torch.float32)
    with pytest.raises(ValueError, match="another run") as e:
        calibrate_streamed(path, FMT, tiny_tokens(seed=9), CFG, out, work=work, dtype=torch.float32, resume=True)
    assert "tokens_sha1 (changed)" in str(e.value)  # says what differs
    other = dataclasses.replace(CFG, seed=CFG.seed + 1, rope_weighting="uniform")
    with pytest.raises(ValueError, match="another run") as e:
        calibrate_streamed(path, FMT, tiny_tokens(), other, out, work=work, dtype=torch.float32, resume=True)
    assert f"calibration.seed {CFG.seed} -> {CFG.seed + 1}" in str(e.value)
    assert "calibration.rope_weighting 'attention' -> 'uniform'" in str(e.value)

    # a crash inside block 1's calibration: nothing of block 1 is committed
    real = stream_mod.calibrate_attention

    def crash(attn, *a, **k):
        if attn.layer_idx == 1:
            raise _Stop
        return real(attn, *a, **k)

    monkeypatch.setattr(stream_mod, "calibrate_attention", crash)
    with pytest.raises(_Stop):
        calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, work=work, dtype=torch.float32, resume=True)
    assert sorted(p.name for p in work.iterdir() if p.name.startswith("block_")) == ["block_00000.safetensors"]
    monkeypatch.setattr(stream_mod, "calibrate_attention", real)
    with open(work / "progress.json") as f:
        first_call = json.load(f)["blocks"]
    rep = calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, work=work, dtype=torch.float32, resume=True)
    # the report covers every block: block 0 as the first call recorded it, then this call's blocks 1 and 2
    assert rep.resumed_blocks == 1 and [b["block"] for b in rep.blocks] == [0, 1, 2]
    assert rep.blocks[0] == first_call[0] and rep.to_dict()["resumed_blocks"] == 1
    got, _ = load_delta(out)
    want, _ = load_delta(ref)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    got, want = load_delta_rounding(out), load_delta_rounding(ref)  # the moments and rotations `merge` writes
    assert sum(k.endswith(".rope.post_rotation") for k in want) == 3
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_merge_refuses_a_delta_of_another_model(tmp_path):
    a = save_sharded(tiny_model("deepseek_v2", seed=0), tmp_path / "m")
    out = tmp_path / "delta.safetensors"
    calibrate_streamed(a, FMT, tiny_tokens(), CFG, out, dtype=torch.float32)
    b = save_sharded(tiny_model("deepseek_v2", seed=1), tmp_path / "other" / "m")  # same name and shapes
    with pytest.raises(CheckpointError, match="differ from those the delta"):
        merge_checkpoint(b, out, tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and not any(p.name.startswith(".merged") for p in tmp_path.iterdir())
    c = save_sharded(tiny_model("deepseek_v2", seed=0, kv_lora_rank=32), tmp_path / "c")
    with pytest.raises(CheckpointError, match="calibrated on"):
        merge_checkpoint(c, out, tmp_path / "merged")
    with safe_open(out, framework="pt") as f:
        assert json.loads(f.metadata()["format"]) == "quantmla-delta"


def test_a_progress_from_before_the_rope_objective_option_names_the_way_back():
    """Progress recorded before ``rope_weighting`` existed was calibrated with the paper's uniform objective: resuming
    it under today's default must fail naming that change and the flag that continues it."""
    new = stream_mod._recipe(FMT, dataclasses.replace(CFG, rope_weighting="attention"), torch.float32, tiny_tokens())
    old = json.loads(json.dumps(new))
    del old["calibration"]["rope_weighting"]
    msg = stream_mod._recipe_changes(old, new)
    assert "calibration.rope_weighting 'uniform' -> 'attention'" in msg and "--rope-weighting uniform" in msg
    assert stream_mod._recipe_changes(None, new) == ""  # progress without a stored recipe: nothing to compare
    same = stream_mod._recipe(FMT, dataclasses.replace(CFG, rope_weighting="uniform"), torch.float32, tiny_tokens())
    assert stream_mod._recipe_changes(old, same) == ""


def test_merge_carries_the_query_moments_and_drops_the_bases(tmp_path):
    """The delta carries each layer's query moment and post-RoPE rotation (the transforms file's, bit for bit); `merge`
    writes them as the merged folder's rounding file, which loading attaches; a base's own rounding file (fitted to
    the weights the delta replaces) is not copied; a delta from before rotations were carried (moments only) merges
    to a folder whose plans have none; a checkpoint tensor may not take the moments' name prefix."""
    from quantmla.cache.hf import rope_rounding_of
    from quantmla.calibrate.delta import ROUNDING_FILE, ROUNDING_PREFIX, save_delta
    from quantmla.calibrate.query_moments import (
        hadamard_rotation,
        load_saved_rope_rounding,
        moments_in,
        rotations_in,
        save_rounding_file,
    )
    from quantmla.calibrate.shipped import load_transforms
    from quantmla.quant.rounding import fit_rope_rounding

    path = save_sharded(tiny_model("deepseek_v2", seed=2), tmp_path / "base")
    save_rounding_file(path, {0: torch.eye(16), 1: torch.eye(16)})  # stale: made for the uncalibrated weights
    out, tf = tmp_path / "delta.safetensors", tmp_path / "t.safetensors"
    calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, dtype=torch.float32, transforms_out=tf)
    carried = load_delta_rounding(out)
    tensors, tmeta = load_transforms(tf)
    want = {k: v for k, v in tensors.items() if k.endswith((".rope.query_moment", ".rope.post_rotation"))}
    assert set(carried) == set(want) and len(want) == 4
    assert all(torch.equal(carried[k], want[k]) for k in want)
    assert tmeta["rope_rounding"] == load_delta(out)[1]["rope_rounding"]  # recorded in both files' metadata
    assert not any(k.startswith(ROUNDING_PREFIX) for k in load_delta(out)[0])  # the weights alone
    merged = merge_checkpoint(path, out, tmp_path / "merged")
    assert (merged / ROUNDING_FILE).is_file()
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert load_saved_rope_rounding(model, merged) == 2
    for i, plan in enumerate(rope_rounding_of(model)):
        assert torch.equal(plan.rotation, hadamard_rotation(16, seed=0))
        ref = fit_rope_rounding(moments_in(want)[i], rotation=rotations_in(want)[i])
        assert torch.equal(plan.order, ref.order) and torch.equal(plan.feedback, ref.feedback)
        assert not torch.equal(moments_in(want)[i], torch.eye(16))  # not the base's stale file

    # a delta written before rotations were carried: its moments alone, no record
    weights, meta = load_delta(out)
    old = save_delta(tmp_path / "old.safetensors", weights, {k: v for k, v in meta.items() if k != "rope_rounding"},
                     rounding={k: v for k, v in want.items() if k.endswith(".rope.query_moment")})  # fmt: skip
    merged_old = merge_checkpoint(path, old, tmp_path / "merged_old")
    model = AutoModelForCausalLM.from_pretrained(merged_old, dtype=torch.float32)
    assert load_saved_rope_rounding(model, merged_old) == 2
    for i, plan in enumerate(rope_rounding_of(model)):
        ref = fit_rope_rounding(moments_in(want)[i])
        assert plan.rotation is None and torch.equal(plan.order, ref.order) and torch.equal(plan.feedback, ref.feedback)
    with pytest.raises(ValueError, match="may not start with"):
        save_delta(tmp_path / "bad.safetensors", {ROUNDING_PREFIX + "x": torch.zeros(1)}, {})


def test_rope_rotation_none_stores_none(tmp_path):
    """``rope_rotation="none"``: the moments alone in the transforms file, the delta and the merged folder, recorded
    as no rotation; an unknown kind is refused before any work."""
    from quantmla.calibrate.query_moments import rotations_in, saved_moments, saved_rounding_plans
    from quantmla.calibrate.shipped import load_transforms

    path = save_sharded(tiny_model("deepseek_v2", seed=2), tmp_path / "base")
    out, tf = tmp_path / "delta.safetensors", tmp_path / "t.safetensors"
    with pytest.raises(ValueError, match="--rope-rotation 'qr'"):
        calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, dtype=torch.float32, rope_rotation="qr")
    assert not out.exists() and not (tmp_path / "delta.safetensors.work").exists()
    rep = calibrate_streamed(path, FMT, tiny_tokens(), CFG, out, dtype=torch.float32, transforms_out=tf,
                             rope_rotation="none")  # fmt: skip
    tensors, tmeta = load_transforms(tf)
    record = {"method": "query-aware", "rotation": None}
    assert rep.rope_rounding == tmeta["rope_rounding"] == load_delta(out)[1]["rope_rounding"] == record
    assert rotations_in(tensors) == {} and rotations_in(load_delta_rounding(out)) == {}
    merged = merge_checkpoint(path, out, tmp_path / "merged")
    assert len(saved_moments(merged)) == 2 and all(p.rotation is None for p in saved_rounding_plans(merged).values())
