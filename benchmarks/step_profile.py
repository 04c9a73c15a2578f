"""Where one decode step's time goes: operator launches against device time, and our attention's share of it.

Issue 10 asks C4R4's time per output token at B32 x 32K on the DeepSeek-V2-Lite-shaped model to be <= 0.6x BF16's;
bench_generate measures 63-69 ms per step for every format there (``generate_h200_v2lite_32k.md``), while the decode
kernels themselves take ~5.7 ms (C4R4) / ~8.6 ms (BF16) for 27 layers. This script says what the rest is: one decode
step of ``bench_generate``'s models under ``torch.profiler`` per cache format, reporting

* ``wall_ms``: the step's median wall time (synchronized, outside the profiler, ``--steps`` steps);
* ``cpu_ops``: top-level ``aten::`` operators the step dispatches (each is at least one launch on the GPU);
* on CUDA ``kernels`` (device kernels launched), ``gpu_ms`` (their summed device time) and ``ours_ms`` (the device
  time of quantmla's own kernels: decode, buffers, merge, writer), with the top kernels by device time.

``wall_ms`` far above ``gpu_ms`` means the step is bound by launches, not by the cache: the remedy is capturing
the step (CUDA graphs), not a faster attention kernel. Writes ``step_profile_<tag>.{json,md}`` to ``--out``::

    PYTHONPATH=src python benchmarks/step_profile.py --model v2-lite --batch 32 --context 32768   # GPU
    python benchmarks/step_profile.py --smoke                                                    # CPU, tiny model
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
from bench_prefill import commit_id  # noqa: E402 - the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
from results_io import add_output_args, result_stem, write_results  # noqa: E402

OURS = ("decode_kernel", "combine_kernel", "_buffers_kernel", "_decode_kernel", "_combine_kernel", "_write")


def top_level_ops(events) -> collections.Counter:
    """``aten::`` operators of a profile that no other ``aten::`` operator called, counted by name."""
    out: collections.Counter = collections.Counter()
    for e in events:
        if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            out[e.name] += 1
    return out


def device_kernels(prof) -> list[tuple[str, int, float]]:
    """(kernel name, launches, device ms) of the profile's device kernels, most time first."""
    rows = []
    for a in prof.key_averages():
        if str(getattr(a, "device_type", "")).endswith("CUDA"):
            us = getattr(a, "self_device_time_total", None)
            us = getattr(a, "self_cuda_time_total", 0.0) if us is None else us
            rows.append((a.key, int(a.count), us / 1e3))
    return sorted(rows, key=lambda r: -r[2])


def profile_format(model, fmt: str, batch: int, n: int, steps: int, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from quantmla.mla.spec import MLASpec

    cache = bg.new_cache(model, fmt, n + steps + 3)
    bg.fill(cache, MLASpec.from_config(model.config), batch, n, device, model.dtype)
    ids = [torch.randint(0, model.config.vocab_size, (batch, 1), device=device)]

    def step() -> None:
        ids[0] = bg.forward(model, ids[0], cache).argmax(-1, keepdim=True)

    wall = bg.median_seconds(step, steps, 1, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        bg.sync(device)
    ops = top_level_ops(prof.events())
    row = {"format": fmt, "batch": batch, "context": n, "wall_ms": 1e3 * wall,
           "cpu_ops": sum(ops.values()), "top_ops": ops.most_common(8)}  # fmt: skip
    if device == "cuda":
        ks = device_kernels(prof)
        row.update(kernels=sum(k[1] for k in ks), gpu_ms=sum(k[2] for k in ks),
                   ours_ms=sum(k[2] for k in ks if any(o in k[0] for o in OURS)),
                   top_kernels=[(k[0][:80], k[1], round(k[2], 3)) for k in ks[:8]])  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v2-lite", help="v2-lite, smollm2-mla or tiny")
    ap.add_argument("--formats", default="hf,bf16,c4r4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model, batch 2, context 64, on the CPU")
    add_output_args(ap, tag=None)  # default tag: <model>_b<batch>_n<context>, smoke with --smoke
    args = ap.parse_args()
    if args.smoke:
        args.model, args.batch, args.context, args.steps, args.device = "tiny", 2, 64, 2, "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is available (use --device cpu or --smoke)")
    tag = args.tag or ("smoke" if args.smoke else f"{args.model}_b{args.batch}_n{args.context}")
    stem = result_stem(args.out, "step_profile", tag, args.force)
    model, desc = bg.build_model(args.model, args.device)
    rows = []
    for fmt in args.formats.split(","):
        rows.append(profile_format(model, fmt, args.batch, args.context, args.steps, args.device))
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("top_")}), flush=True)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"device": device, "date": date, "commit": commit_id(), "command": " ".join(sys.argv), "model": desc,
            "layers": model.config.num_hidden_layers}  # fmt: skip
    write(stem, meta, rows)
    return 0


def write(stem: str, meta: dict, rows: list[dict]) -> None:
    gpu = any("gpu_ms" in r for r in rows)
    lines = [f"# One decode step profiled, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`: {meta['model']}, {meta['layers']} layers. `wall` = median synchronized step time "
             "(outside the profiler); `aten ops` = top-level operators dispatched by the step"
             + ("; `kernels` / `GPU ms` = device kernels and their summed device time; `ours` = quantmla's decode, "
                "buffer, merge and writer kernels." if gpu else "."), "",
             "| format | B x context | wall ms | aten ops" + (" | kernels | GPU ms | ours ms | GPU / wall |" if gpu
                                                               else " |"),
             "|---|---|---|---" + ("|---|---|---|---|" if gpu else "|")]  # fmt: skip
    for r in rows:
        cells = f"| {r['format']} | {r['batch']} x {r['context']} | {r['wall_ms']:.2f} | {r['cpu_ops']}"
        if gpu:
            cells += f" | {r['kernels']} | {r['gpu_ms']:.2f} | {r['ours_ms']:.2f} | {r['gpu_ms'] / r['wall_ms']:.2f}"
        lines.append(cells + " |")
    for r in rows:
        lines += ["", f"{r['format']}: most frequent operators {r['top_ops']}"]
        if gpu:
            lines.append(f"{r['format']}: top kernels by device time (name, launches, ms) {r['top_kernels']}")
    write_results(stem, {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
