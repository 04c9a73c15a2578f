"""Test helpers: tiny models saved as sharded safetensors checkpoints and in DeepSeek's FP8 block format.

``fp8_checkpoint`` converts a saved checkpoint the way DeepSeek ships V3 / Kimi-K2: every linear weight inside
the decoder blocks (not norms, the router, embeddings or ``lm_head``) becomes ``float8_e4m3fn`` with one fp32
``weight_scale_inv`` per block (``amax / 448``), and ``config.json`` gets the ``quantization_config``. It also
writes the same checkpoint dequantized by a plain float64 loop over the blocks (the independent reference),
which transformers' own ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0


def save_sharded(model, path: Path, shard: str = "40KB") -> Path:
    model.save_pretrained(path, max_shard_size=shard)
    assert (path / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    return path


def _fp8_eligible(name: str, t: torch.Tensor) -> bool:
    return (
        t.dim() == 2
        and name.endswith(".weight")
        and ".layers." in name
        and "norm" not in name
        and not name.endswith("mlp.gate.weight")
    )


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes [R, C] and fp32 scales [ceil(R / b0), ceil(C / b1)] (``amax / 448`` per block)."""
    (r, c), (b0, b1) = w.shape, block
    nb0, nb1 = -(-r // b0), -(-c // b1)
    padded = torch.zeros(nb0 * b0, nb1 * b1)
    padded[:r, :c] = w.float()
    blocks = padded.view(nb0, b0, nb1, b1)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)  # [nb0, nb1]
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb0 * b0, nb1 * b1)[:r, :c].contiguous()
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float64 block by block, rounded once to fp32 (the product of an FP8 value and an fp32 scale is exact in
    float64, so this is the correctly rounded fp32 product)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            out[sl] = q[sl].to(torch.float64) * float(scale[i, j])
    return out.to(torch.float32)


def fp8_checkpoint(src: Path, dst: Path, deq: Path | None, block: tuple[int, int] = (32, 32)) -> tuple[Path, Path]:
    """Write ``src`` (a sharded checkpoint) in FP8 block format to ``dst`` and dequantized (reference) to ``deq``
    (skipped when None)."""
    dst.mkdir()
    if deq is not None:
        deq.mkdir()
    with open(src / "model.safetensors.index.json") as f:
        index = json.load(f)
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        q_part, d_part = {}, {}
        with safe_open(src / shard, framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if _fp8_eligible(k, t):
                    q, s = quantize_blocks(t, block)
                    q_part[k], q_part[k + "_scale_inv"] = q, s
                    if deq is not None:
                        d_part[k] = dequantize_reference(q, s, block)
                    new_map[k + "_scale_inv"] = shard
                else:
                    q_part[k] = d_part[k] = t
                new_map[k] = shard
        save_file(q_part, dst / shard, metadata={"format": "pt"})
        if deq is not None:
            save_file(d_part, deq / shard, metadata={"format": "pt"})
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": new_map}, f)
    with open(src / "config.json") as f:
        cfg = json.load(f)
    if deq is not None:
        shutil.copy(src / "model.safetensors.index.json", deq / "model.safetensors.index.json")
        with open(deq / "config.json", "w") as f:
            json.dump(cfg, f)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    return dst, deq


def tiny_calibration():
    """The tiny C2R4 format, calibration config and 6 x 64 token bank the streamed-calibration tests share."""

    from quantmla.calibrate.config import CalibrationConfig
    from quantmla.quant.formats import CacheFormat
    from quantmla.quant.spec import QuantSpec

    fmt = CacheFormat("c2r4-tiny", QuantSpec(bits=2, group_size=32), QuantSpec(bits=4, group_size=16))
    cfg = CalibrationConfig(
        seq_len=64, batch_size=2, train_seqs=4, val_seqs=2, steps_content=3, steps_rope=3, query_tokens=16, sink=4,
        local=16, smoothquant_alphas=(0.5,), progress=False, device="cpu",
    )  # fmt: skip
    return fmt, cfg, tiny_tokens()


def tiny_tokens(seed: int = 0):
    import torch

    return torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(seed))
