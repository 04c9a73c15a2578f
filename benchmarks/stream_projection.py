"""Projected time and memory of streamed QuantMLA calibration (``quantmla calibrate-stream``) of DeepSeek-V3 and
Kimi-K2 on one GPU, from the cost of one decoder block.

Memory follows from the shapes (exact): one MoE block's weights in BF16 on the GPU, its FP8 bytes read from disk,
and the three activation banks (hidden states in, out, and attention inputs: N x T x D in BF16 each) in host
memory. Time is a *projection*: 61 x the cost of one MoE block (read + dequantize, forward of the calibration
bank, calibration of its attention layer at the paper's budget), plus the embedding pass.

``--measure`` measures that block cost on this machine: it writes one decoder block of the model with random
weights in DeepSeek's FP8 block format (real shapes unless ``--scale``), runs ``calibrate_streamed`` on it with
the chosen budget and records per-stage seconds and peak memory. Without ``--measure`` the block cost comes from
an analytic model (FLOPs and bytes over stated device throughputs), labelled as such.

Only a real-shape block on the GPU gives a meaningful per-block time (and the projection row): one V3 block is
10.7 GiB of FP8 (K2 15.9 GiB) written to ``--workdir`` and 21-32 GiB in BF16 on the device, with the paper's
160 x 2048-token banks (13 GiB of host memory). A CPU cannot hold that block and its banks at a useful speed;
``--scale N`` (widths and experts / N) with ``--preset smoke`` only checks the code path there: its seconds say
nothing about an H200, and the report gives no projection for it.

    python benchmarks/stream_projection.py --model deepseek-v3                       # analytic only, seconds
    python benchmarks/stream_projection.py --model kimi-k2 --measure --scale 32 --device cpu --preset smoke \\
        --tag cpu-smoke                                                                # CPU: the code path only

GPU (the lead; needs no SmolLM2 kit, so it can ride along the kit's carry calls of device_smollm2_setup.sh; one call
per model, ~5 min each, estimated; timeout_s 600)::

    export PYTHONPATH=$PWD/src; QUANTMLA_COMMIT=<sha> python benchmarks/stream_projection.py --model deepseek-v3 \\
        --measure --device cuda --workdir /tmp/v3blk; cp benchmarks/results/stream_projection_deepseek-v3.* $OUT/
    (the same with --model kimi-k2 --workdir /tmp/k2blk); then copy the returned .md/.json into benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Public config.json values (attention, MoE and vocabulary shapes that set the costs).
MODELS = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840,
    ),
    "kimi-k2": dict(
        model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        routed_scaling_factor=2.827, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
                             beta_fast=1, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=131072,
    ),
}  # fmt: skip

# Assumptions of the analytic model (H200): sustained rates for this workload, not peak numbers.
ASSUME = {"disk_gb_s": 2.0, "bf16_tflops": 250.0, "fp32_tflops": 40.0, "device": "H200 (assumed rates)"}


def block_params(c: dict) -> dict:
    d, h = c["hidden_size"], c["num_attention_heads"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    attn = (d * c["q_lora_rank"] + c["q_lora_rank"] * h * (dn + dr) + d * (c["kv_lora_rank"] + dr)
            + c["kv_lora_rank"] * h * (dn + dv) + h * dv * d)  # fmt: skip
    expert = 3 * d * c["moe_intermediate_size"]
    return {"attention": attn, "routed_experts": c["n_routed_experts"] * expert,
            "shared_experts": c["n_shared_experts"] * expert, "active": attn + (c["num_experts_per_tok"]
            + c["n_shared_experts"]) * expert}  # fmt: skip


def analytic(c: dict, cal) -> dict:
    """Per-MoE-block memory (exact) and seconds (analytic, ASSUME rates) of streamed calibration."""
    p = block_params(c)
    total = p["attention"] + p["routed_experts"] + p["shared_experts"]
    n, t, d = cal.train_seqs + cal.val_seqs, cal.seq_len, c["hidden_size"]
    h, dc, dr = c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    fwd_flops = n * t * (2 * p["active"] + 2 * h * (c["qk_nope_head_dim"] + dr + c["v_head_dim"]) * t / 2)
    q = cal.query_tokens or t
    q_out = h * (c["qk_nope_head_dim"] + dr)
    step_proj = 2 * cal.batch_size * t * (d * (c["q_lora_rank"] + dc + dr) + c["q_lora_rank"] * q_out)
    step_attn = 3 * 2 * 2 * cal.batch_size * h * q * t * (dc + dr + dc)  # ref + quantized, fwd + bwd
    steps = cal.steps_content + cal.steps_rope
    evals = 2 * (3 + len(cal.smoothquant_alphas)) * cal.val_seqs / cal.batch_size  # candidate validations
    calib_flops = (steps + evals) * (step_proj + step_attn)
    secs = {"load_s": total / 1e9 / ASSUME["disk_gb_s"], "forward_s": fwd_flops / ASSUME["bf16_tflops"] / 1e12,
            "calibrate_s": calib_flops / ASSUME["fp32_tflops"] / 1e12}  # fmt: skip
    return {"block_params": total, "block_fp8_bytes": total, "block_bf16_bytes": 2 * total,
            "bank_bytes": 3 * n * t * d * 2, "seconds": secs, "seconds_total": sum(secs.values())}  # fmt: skip


def _one_block_checkpoint(c: dict, workdir: str, device: torch.device, scale: int) -> dict:
    """Write one MoE decoder block (+ embedding) with random weights in FP8 block format; return its config."""
    from safetensors.torch import save_file

    from quantmla.calibrate.checkpoint import meta_model

    cfg = dict(c, num_hidden_layers=1, first_k_dense_replace=0)
    if scale > 1:  # shrink widths and expert count, keep the structure (CPU smoke runs)
        for k in ("hidden_size", "moe_intermediate_size", "intermediate_size", "q_lora_rank"):
            cfg[k] = max(128, cfg[k] // scale)
        cfg["n_routed_experts"] = max(cfg["num_experts_per_tok"] * cfg["n_group"], cfg["n_routed_experts"] // scale)
        cfg["num_attention_heads"] = cfg["num_key_value_heads"] = max(4, cfg["num_attention_heads"] // scale)
        cfg["vocab_size"] = 4096
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**cfg)
    model = meta_model(hf, torch.bfloat16)
    model.model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.model.state_dict(keep_vars=True).items():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.zero_()
        for key, t in _checkpoint_names("model." + name, p.detach()):
            if t.dim() == 2 and ".layers." in key and "norm" not in key and not key.endswith("mlp.gate.weight"):
                q, s = _quantize(t)
                tensors[key], tensors[key + "_scale_inv"] = q.cpu(), s.cpu()
            else:
                tensors[key] = t.to(torch.bfloat16).cpu()
    tensors["lm_head.weight"] = torch.zeros(hf.vocab_size, hf.hidden_size, dtype=torch.bfloat16)
    os.makedirs(workdir, exist_ok=True)
    save_file(tensors, os.path.join(workdir, "model.safetensors"), metadata={"format": "pt"})
    d = hf.to_dict()
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}  # fmt: skip
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(d, f)
    return cfg


def _checkpoint_names(name: str, t: torch.Tensor):
    if name.endswith("experts.gate_up_proj"):
        half = t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight", t[e, :half]
            yield f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight", t[e, half:]
    elif name.endswith("experts.down_proj"):
        for e in range(t.shape[0]):
            yield f"{name[: -len('down_proj')]}{e}.down_proj.weight", t[e]
    else:
        yield name, t


def _quantize(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = w.shape
    nb0, nb1 = -(-r // b), -(-c // b)
    pad = torch.zeros(nb0 * b, nb1 * b, device=w.device, dtype=torch.float32)
    pad[:r, :c] = w.float()
    blk = pad.view(nb0, b, nb1, b)
    s = (blk.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    q = (blk / s[:, None, :, None]).to(torch.float8_e4m3fn).view(nb0 * b, nb1 * b)[:r, :c].contiguous()
    return q, s


def measure(c: dict, cal, device: torch.device, workdir: str, scale: int) -> dict:
    from quantmla.calibrate.stream import calibrate_streamed

    t0 = time.time()
    cfg = _one_block_checkpoint(c, workdir, device, scale)
    write_s = time.time() - t0
    n = cal.train_seqs + cal.val_seqs
    tokens = torch.randint(0, cfg["vocab_size"], (n, cal.seq_len), generator=torch.Generator().manual_seed(0))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rep = calibrate_streamed(workdir, "c4r4", tokens, cal, os.path.join(workdir, "delta.safetensors"),
                             dtype=torch.bfloat16, force=True)  # fmt: skip
    blk = rep.blocks[0]
    out = {"write_checkpoint_s": write_s, "load_s": blk["load_s"], "forward_s": blk["forward_s"],
           "calibrate_s": blk["calibrate_s"], "block_bytes": blk["block_bytes"], "bank_bytes": rep.bank_bytes,
           "peak_host_rss_bytes": blk["peak_rss_bytes"], "total_s": rep.seconds, "scale": scale}  # fmt: skip
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def main() -> None:
    from quantmla.calibrate.config import MATMUL_PRECISIONS, CalibrationConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="deepseek-v3")
    ap.add_argument("--preset", default="paper", help="calibration preset (paper = Table 7)")
    ap.add_argument("--measure", action="store_true", help="measure one real-shape block on --device")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=1, help="shrink widths / experts by this factor (CPU smoke runs)")
    ap.add_argument("--workdir", default="/tmp/quantmla_stream_block")
    ap.add_argument("--tag", default=None, help="results/stream_projection_<tag>.{json,md} (default: the model)")
    ap.add_argument("--matmul-precision", default="fp32", choices=MATMUL_PRECISIONS,
                    help="CalibrationConfig.matmul_precision of the measured block (tf32: TF32 tensor cores)")
    args = ap.parse_args()
    cal = CalibrationConfig.preset(args.preset, device=args.device, progress=False,
                                   matmul_precision=args.matmul_precision)  # fmt: skip
    c = MODELS[args.model]
    res = {"model": args.model, "preset": args.preset, "calibration": cal.to_dict(), "analytic": analytic(c, cal),
           "assumptions": ASSUME, "layers": c["num_hidden_layers"]}  # fmt: skip
    if args.measure:
        try:
            res["measured_block"] = measure(c, cal, torch.device(args.device), args.workdir, args.scale)
        finally:
            shutil.rmtree(args.workdir, ignore_errors=True)
    _write(res, args)


def _write(res: dict, args) -> None:
    commit = os.environ.get("QUANTMLA_COMMIT") or subprocess.run(  # the device's tree has no .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.machine()})"
    res.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
               device=dev, command="python benchmarks/stream_projection.py " + " ".join(os.sys.argv[1:]))  # fmt: skip
    a, n = res["analytic"], res["layers"]
    gib = 1 << 30
    lines = [f"# Streamed calibration of {args.model}: projection ({res['date']}, commit {commit})", "",
             f"Command: `{res['command']}`. Calibration preset `{args.preset}`. **Projection**, not a full run.", "",
             "| quantity | value |", "|---|---|",
             f"| one MoE block: parameters / FP8 bytes read / BF16 on the device | {a['block_params'] / 1e9:.2f} B / "
             f"{a['block_fp8_bytes'] / gib:.1f} GiB / {a['block_bf16_bytes'] / gib:.1f} GiB |",
             f"| activation banks in host memory (3 x N x T x D, BF16) | {a['bank_bytes'] / gib:.1f} GiB |",
             f"| peak device memory, estimated as 2 x the BF16 block (the CPU test measured 1.96x: the block plus "
             f"the MoE forward's transient copies) | {2 * a['block_bf16_bytes'] / gib:.0f} GiB |",
             "| analytic seconds per block (load / forward / calibrate) | "
             + " / ".join(f"{v:.0f}" for v in a["seconds"].values()) + " |",
             f"| analytic projection, {n} blocks | {n * a['seconds_total'] / 3600:.2f} h |"]  # fmt: skip
    m = res.get("measured_block")
    if m:
        per = m["load_s"] + m["forward_s"] + m["calibrate_s"]
        scaled = f" (scaled 1/{m['scale']})" if m["scale"] > 1 else ""
        lines += [f"| measured on {dev}{scaled}: seconds "
                  f"per block (load / forward / calibrate) | {m['load_s']:.1f} / {m['forward_s']:.1f} / "
                  f"{m['calibrate_s']:.1f} |",
                  f"| measured: peak GPU memory / peak host RSS | "
                  f"{m.get('peak_gpu_bytes', 0) / gib:.1f} GiB / "
                  f"{m['peak_host_rss_bytes'] / gib:.1f} GiB |"]  # fmt: skip
        if m["scale"] == 1:
            lines.append(f"| projection from the measured block, {n} blocks | {n * per / 3600:.2f} h |")
    lines += ["", f"Analytic rates assumed: {json.dumps(ASSUME)}. Dense blocks (the first "
              f"{MODELS[args.model]['first_k_dense_replace']}) are cheaper than MoE blocks; counting every block as "
              "MoE makes the projection an upper bound for those."]  # fmt: skip
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"stream_projection_{args.tag or args.model}")
    for ext, text in ((".json", json.dumps(res, indent=2)), (".md", "\n".join(lines) + "\n")):
        with open(stem + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(stem + ext + ".tmp", stem + ext)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
