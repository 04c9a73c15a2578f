"""Reading checkpoints one module at a time: FP8 block dequantization against a float64 loop, and every tiny
family loaded from its shards exactly as transformers' own loader builds it (fused experts included)."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import dequantize_reference, fp8_checkpoint, quantize_blocks, save_sharded
from transformers import AutoModelForCausalLM

from quantmla.calibrate.checkpoint import (
    CheckpointError,
    CheckpointReader,
    dequantize_fp8_blocks,
    load_config,
    load_full_model,
    load_module_tensors,
    meta_model,
)
from quantmla.mla.tiny import TINY_MODELS, tiny_model


def test_dequantize_ragged_blocks_matches_float64_loop():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 21, generator=g) * torch.logspace(-3, 2, 21)  # columns of very different ranges
    q, s = quantize_blocks(w, (4, 8))  # 3 x 3 blocks, the last row and column of blocks partial
    assert s.shape == (3, 3)
    ref = dequantize_reference(q, s, (4, 8))
    got = dequantize_fp8_blocks(q, s, (4, 8), torch.float32)
    assert torch.equal(got, ref)
    assert torch.equal(dequantize_fp8_blocks(q, s, (4, 8), torch.bfloat16), ref.to(torch.bfloat16))
    assert (got - w).abs().max() <= 0.07 * w.abs().max()  # and it is a dequantization of w (FP8: 3 mantissa bits)
    with pytest.raises(CheckpointError, match=r"scale_inv of shape \(3, 3\)"):
        dequantize_fp8_blocks(q, s[:2], (4, 8), torch.float32)


@pytest.mark.parametrize("family", TINY_MODELS)
def test_every_family_loads_module_by_module_like_transformers(family, tmp_path):
    src = tiny_model(family, seed=3)
    path = save_sharded(src, tmp_path / family)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    got = load_full_model(path).state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    src = save_sharded(tiny_model("deepseek_v3", seed=1), tmp_path / "bf")
    fp8, deq = fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq")
    reader = CheckpointReader(fp8, torch.float32)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert reader.raw(name).dtype == torch.float8_e4m3fn and reader.is_fp8(name)
    ref = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).state_dict()
    got = load_full_model(fp8).state_dict()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # stored scale without FP8 data, or FP8 data without a scale: refused with the tensor's name
    reader.weight_map["model.layers.1.mlp.gate.weight_scale_inv"] = reader.weight_map[name]
    with pytest.raises(CheckpointError, match="mlp.gate.weight"):
        reader.read("model.layers.1.mlp.gate.weight")


def test_missing_tensor_is_named(tmp_path):
    path = save_sharded(tiny_model("deepseek_v2"), tmp_path / "m")
    reader = CheckpointReader(path, torch.float32)
    del reader.weight_map["model.layers.0.self_attn.kv_b_proj.weight"]
    model = meta_model(load_config(path), torch.float32)
    with pytest.raises(CheckpointError, match="kv_b_proj"):
        load_module_tensors(model.model.layers[0], "model.layers.0.", reader)
    with pytest.raises(CheckpointError, match="config.json"):
        CheckpointReader(tmp_path)
