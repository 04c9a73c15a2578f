"""Where a paper-budget calibration spends its time on the GPU (issue 12: ~300 s per QuantMLA calibration of the
30-layer SmolLM2-MLA on an H200, 11 of them still to run).

A random-init MLA model with SmolLM2-MLA's attention shapes (hidden 576, 9 heads, latent 256, RoPE 128, nope 64,
value 64; ``--layers`` decoder blocks, default 2) is calibrated for C4R4 with the paper's banks (128 + 32 sequences
of 2048 tokens, batch 4, 256 query tokens) and ``--steps`` steps per path: first timed as it is (seconds per layer
and per training step), then once more under ``torch.profiler``, whose table (top operators by device time and by
host time, and the host-device synchronizations: ``cudaStreamSynchronize`` / ``cudaMemcpy*``) says whether the steps
are bound by the device, the host, or waits. ``--precisions fp32,tf32`` times each of CalibrationConfig's
``matmul_precision`` settings in the same run (a fresh model each, after a warm-up; the profile is of the first), so
their ratio is measured side by side. Needs no model download; writes ``calib_profile_<tag>.{json,md}``::

    PYTHONPATH=src python benchmarks/calib_profile.py --out $OUT/b --tag h200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import gpu_tag, write_results  # noqa: E402

SHAPES = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=9, kv_lora_rank=256, qk_rope_head_dim=128,
              qk_nope_head_dim=64, v_head_dim=64, intermediate_size=1536, vocab_size=1024,
              max_position_embeddings=4096, rope_parameters=dict(rope_type="default", rope_theta=10000.0))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100, help="training steps per path (the paper: 300)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="paper", help="calibration preset of the banks (smoke: a CPU check)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="default: the GPU model that runs (h100, h200)")
    ap.add_argument("--precisions", default="fp32,tf32", help="matmul_precision settings to time, comma-separated")
    args = ap.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("calib_profile.py: no CUDA GPU here (pass --device cpu for a CPU profile)")
    from quantmla.calibrate.config import CalibrationConfig
    from quantmla.calibrate.trainer import calibrate_model
    from quantmla.mla.tiny import tiny_model

    cfgs = {p: CalibrationConfig.preset(args.preset, device=args.device, steps_content=args.steps,
                                        steps_rope=args.steps, progress=False, matmul_precision=p)
            for p in precisions}  # fmt: skip
    cfg = cfgs[precisions[0]]
    tokens = torch.randint(SHAPES["vocab_size"], (cfg.train_seqs + cfg.val_seqs, cfg.seq_len),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip

    def model():  # a fresh one per run: calibration folds its transforms into the weights
        return tiny_model("deepseek_v2", num_hidden_layers=args.layers, **SHAPES)

    def run(m, c=cfg):
        t0 = time.perf_counter()
        rep = calibrate_model(m, "c4r4", tokens, c)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, rep

    timed = {}
    for p in precisions:
        run(model(), cfgs[p])  # warm-up: kernels, allocator, cuBLAS handles
        w, r = run(model(), cfgs[p])
        val = r.summary()
        timed[p] = {"wall_s": round(w, 2), "layer_s": [round(x.seconds, 2) for x in r.layers],
                    "content_val_chosen": val["content_val_chosen"], "rope_val_chosen": val["rope_val_chosen"]}
        print(f"{p}: wall {w:.2f} s, layers {timed[p]['layer_s']} s", flush=True)
    wall, layer_s = timed[precisions[0]]["wall_s"], timed[precisions[0]]["layer_s"]
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])  # fmt: skip
    m = model()
    with torch.profiler.profile(activities=acts) as prof:
        run(m)
    ka = prof.key_averages()
    dev_key = "device_time_total" if hasattr(ka[0], "device_time_total") else "cuda_time_total"
    rows = [{"op": e.key, "calls": e.count, "host_ms": e.self_cpu_time_total / 1e3,
             "device_ms": getattr(e, dev_key, 0) / 1e3} for e in ka]  # fmt: skip
    syncs = [r for r in rows if r["op"] in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                                            "cudaMemcpy", "cudaEventSynchronize")]  # fmt: skip
    steps = 2 * args.steps * args.layers
    meta = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
            "commit": os.environ.get("QUANTMLA_COMMIT", "unknown"), "command": " ".join(sys.argv),
            "layers": args.layers, "steps_per_path": args.steps,
            "ms_per_step_upper_bound": round(1e3 * wall / steps, 2), "precisions": timed}  # fmt: skip
    top_dev = sorted(rows, key=lambda r: -r["device_ms"])[:15]
    top_host = sorted(rows, key=lambda r: -r["host_ms"])[:15]
    lines = [f"# Calibration profile, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`: C4R4, {args.preset} banks, {args.steps} steps per path, {args.layers} layers of "
             f"SmolLM2-MLA's attention shapes. Wall {wall:.1f} s (layers {layer_s} s): at most "
             f"{meta['ms_per_step_upper_bound']} ms per training step, validation and banks included.", "",
             "| matmul_precision | wall s | layers s | x first | content val NMSE | RoPE val NMSE |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for p, t in timed.items():
        lines.append(f"| {p} | {t['wall_s']:.2f} | {t['layer_s']} | {wall / t['wall_s']:.2f}x | "
                     f"{t['content_val_chosen']:.4g} | {t['rope_val_chosen']:.4g} |")  # fmt: skip
    lines += ["", f"Profile: {precisions[0]}.", ""]
    for title, sel in (("by device time", top_dev), ("by host time (self)", top_host), ("synchronizations", syncs)):
        lines += [f"## {title}", "", "| op | calls | host ms | device ms |", "|---|---|---|---|"]
        lines += [f"| `{r['op'][:60]}` | {r['calls']} | {r['host_ms']:.1f} | {r['device_ms']:.1f} |" for r in sel]
        lines.append("")
    write_results(os.path.join(args.out, f"calib_profile_{args.tag or gpu_tag()}"),
                  {".json": json.dumps({"meta": meta, "ops": rows}, indent=1), ".md": "\n".join(lines)})  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
