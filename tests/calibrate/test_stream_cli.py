"""``quantmla calibrate-stream`` and ``quantmla merge`` end to end on a tiny sharded checkpoint: the merged
checkpoint loads in transformers with the same full-precision logits and the post-RoPE rotation ``--rope-rotation``
chose, and bad input gets a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_util import save_sharded
from transformers import AutoModelForCausalLM

from quantmla.cli import main
from quantmla.mla.tiny import tiny_model

FLAGS = ["--seq-len", "64", "--train-seqs", "4", "--val-seqs", "2", "--steps", "2", "--query-tokens", "16",
         "--sink", "4", "--local", "16", "--batch-size", "2", "--device", "cpu", "--dtype", "float32", "--no-progress"]


@pytest.mark.parametrize("rotation", ["hadamard", "none"])
def test_calibrate_stream_then_merge(rotation, tmp_path, capsys):
    from quantmla.calibrate.query_moments import hadamard_rotation, saved_rounding_plans
    from quantmla.calibrate.shipped import load_transforms

    model = tiny_model("glm4_moe_lite", seed=1)
    base = save_sharded(model, tmp_path / "base")
    toks = tmp_path / "tokens.pt"
    torch.save(torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(0)), toks)
    delta = tmp_path / "d.safetensors"
    assert main(["calibrate-stream", "--model", str(base), "--format", "c2r4", "--out", str(delta), "--tokens",
                 str(toks), "--report", str(tmp_path / "rep.json"), "--transforms", str(tmp_path / "t.safetensors"),
                 *FLAGS, *([] if rotation == "hadamard" else ["--rope-rotation", "none"])]) == 0  # fmt: skip
    assert delta.exists() and (tmp_path / "rep.json").exists() and (tmp_path / "t.safetensors").exists()
    assert main(["merge", "--base", str(base), "--delta", str(delta), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # folding keeps the full-precision function
        torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    # the rotation (hadamard by default, seed 0, every layer; none with --rope-rotation none), recorded alike
    record = json.loads((tmp_path / "rep.json").read_text())["rope_rounding"]
    assert json.loads((tmp_path / "merged" / "quantmla_delta.json").read_text())["rope_rounding"] == record
    assert load_transforms(tmp_path / "t.safetensors")[1]["rope_rounding"] == record
    plans = saved_rounding_plans(tmp_path / "merged")
    assert len(plans) == model.config.num_hidden_layers
    want = hadamard_rotation(model.config.qk_rope_head_dim, seed=0) if rotation == "hadamard" else None
    for plan in plans.values():
        assert plan.rotation is None if want is None else torch.equal(plan.rotation, want)
    assert record == {"method": "query-aware", "rotation": None if rotation == "none" else
                      {"kind": "hadamard", "seed": 0, "where": "after RoPE, at cache write and read"}}  # fmt: skip
    assert main(["merge", "--base", str(base), "--delta", str(delta), "--out", str(tmp_path / "merged")]) == 2
    assert "exists" in capsys.readouterr().err
    shard = sorted(base.glob("model-*.safetensors"))[0]
    assert main(["merge", "--base", str(base), "--delta", str(shard), "--out", str(tmp_path / "m2")]) == 1
    assert "not a quantmla delta" in capsys.readouterr().err
    assert main(["calibrate-stream", "--model", str(base), "--out", str(tmp_path / "e.safetensors"), *FLAGS]) == 2
    assert "tokenizer" in capsys.readouterr().err
