"""Peak resident memory of streamed calibration stays near one decoder block plus the activation banks.

A model whose weights are dominated by its MoE blocks (4 blocks of ~38 MB in fp32, ~150 MB in all) is saved in
DeepSeek's FP8 block format. A fresh Python process builds the model skeleton (importing the model code), resets
its peak-RSS counter (``/proc/self/clear_refs``), calibrates, and reports the peak resident set above that
point. Streamed, the peak must stay within two blocks plus the banks plus 32 MiB (mapped FP8 pages, allocator
slack); the same calibration in memory (the whole model loaded, then ``calibrate_model``) is run as the control
and must exceed that bound, so the measurement can tell the two apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_util import fp8_checkpoint, save_sharded

import quantmla
from quantmla.mla.tiny import tiny_model

MIB = 1 << 20
CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from quantmla.calibrate.checkpoint import load_config, load_full_model, meta_model
from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.stream import calibrate_streamed, rss_bytes
from quantmla.calibrate.trainer import calibrate_model
from quantmla.quant.formats import CacheFormat
from quantmla.quant.spec import QuantSpec

mode, path, out = sys.argv[1:4]
fmt = CacheFormat("c2r4-tiny", QuantSpec(bits=2, group_size=32), QuantSpec(bits=4, group_size=16))
cfg = CalibrationConfig(seq_len=64, batch_size=2, train_seqs=4, val_seqs=2, steps_content=2, steps_rope=2,
                        query_tokens=16, sink=4, local=16, smoothquant_alphas=(0.5,), progress=False, device="cpu")
tokens = torch.randint(3, 128, (6, 64), generator=torch.Generator().manual_seed(0))
meta_model(load_config(path), torch.float32)  # import the model code before measuring
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before, _ = rss_bytes()
res = {}
if mode == "stream":
    rep = calibrate_streamed(path, fmt, tokens, cfg, out, dtype=torch.float32)
    res = {"block_bytes": rep.block_bytes_max, "bank_bytes": rep.bank_bytes}
else:
    model = load_full_model(path, torch.float32)
    calibrate_model(model, fmt, tokens, cfg)
    res = {"model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}
_, peak = rss_bytes()
print(json.dumps({"peak_above_start": peak - before, **res}))
"""


def _run(mode: str, path: Path, out: Path) -> dict:
    src = str(Path(quantmla.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(out)], capture_output=True, text=True,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_peak_memory_is_one_block_plus_banks_not_the_model(tmp_path):
    model = tiny_model(
        "deepseek_v3", num_hidden_layers=4, first_k_dense_replace=0, hidden_size=256, moe_intermediate_size=256,
        n_routed_experts=96, num_experts_per_tok=2, n_group=1, topk_group=1,
    )  # fmt: skip
    src = save_sharded(model, tmp_path / "bf", shard="20MB")
    del model
    fp8, _ = fp8_checkpoint(src, tmp_path / "fp8", None, block=(128, 128))
    streamed = _run("stream", fp8, tmp_path / "delta.safetensors")
    bound = 2 * streamed["block_bytes"] + streamed["bank_bytes"] + 32 * MIB
    assert streamed["block_bytes"] <= streamed["peak_above_start"] <= bound, streamed  # holds one block, not more
    control = _run("memory", fp8, tmp_path / "unused")
    assert control["model_bytes"] > 3 * streamed["block_bytes"]
    assert control["peak_above_start"] > bound, (control, bound)  # the in-memory run breaks the same bound
