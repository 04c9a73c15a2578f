"""Where one step's time goes: operator launches against device time, and our attention's share of it.

Issue 10 asks C4R4's time per output token at B32 x 32K on the DeepSeek-V2-Lite-shaped model to be <= 0.6x BF16's;
bench_generate measures 63-69 ms per step for every format there (``generate_h200_v2lite_32k.md``), while the decode
kernels themselves take ~5.7 ms (C4R4) / ~8.6 ms (BF16) for 27 layers. This script says what the rest is: one decode
step of ``bench_generate``'s models under ``torch.profiler`` per cache format, reporting

* ``wall_ms``: the step's median wall time (synchronized, outside the profiler, ``--steps`` steps);
* ``cpu_ops``: top-level ``aten::`` operators the step dispatches (each is at least one launch on the GPU);
* on CUDA ``kernels`` (device kernels launched), ``gpu_ms`` (their summed device time) and ``ours_ms`` (the device
  time of quantmla's own kernels: decode, buffers, merge, writer), with the top kernels by device time.

``wall_ms`` far above ``gpu_ms`` means the step is bound by launches, not by the cache: the remedy is capturing
the step (CUDA graphs), not a faster attention kernel.

``--prefill`` profiles prompt ingestion instead (``generate_h200_v2lite_32k.md``: 3-4x transformers' own time):
one prompt of ``--context`` tokens at batch 1, in forwards of ``--prefill-chunk`` tokens into a fresh cache
(``bench_generate.ingest``, as its prefill timing does), one warm-up ingestion first; per format ``wall_s`` (median
of ``--steps`` ingestions outside the profiler), device kernels and their summed time, quantmla's kernels, and the
time inside ranges: every decoder layer's attention and MLP module (``model.self_attn``, ``model.mlp``) and, inside
our cache, the prefill attention call, the store and the mask check (``quantmla.*``, :mod:`quantmla.cache.layer`).
On a CPU run the "kernels" are the ``aten::`` operators and the time is their CPU time.

Writes ``step_profile_<tag>.{json,md}`` to ``--out`` (after every format: a killed run keeps the rows done)::

    PYTHONPATH=src python benchmarks/step_profile.py --model v2-lite --batch 32 --context 32768   # GPU
    PYTHONPATH=src python benchmarks/step_profile.py --prefill --model v2-lite --context 4096,32768   # GPU
    python benchmarks/step_profile.py --smoke [--prefill]                                        # CPU, tiny model
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
MODULES = ("self_attn", "mlp")  # submodules of every decoder layer given a range: model.self_attn, model.mlp
CACHE_RANGES = ("quantmla.prefill_attention", "quantmla.store", "quantmla.mask")  # quantmla.cache.layer's ranges
RANGES = tuple(f"model.{m}" for m in MODULES) + CACHE_RANGES


def top_level_ops(events) -> collections.Counter:
    """``aten::`` operators of a profile that no other ``aten::`` operator called, counted by name."""
    out: collections.Counter = collections.Counter()
    for e in events:
        if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            out[e.name] += 1
    return out


def device_kernels(prof, device: str = "cuda") -> list[tuple[str, int, float]]:
    """(kernel name, launches, ms) of the profile's device kernels (and copies), most time first; the ranges'
    device-side spans are left out. On a CPU run: the ``aten::`` operators and their self CPU time."""
    rows = []
    for a in prof.key_averages():
        if device != "cuda":
            if a.key.startswith("aten::"):
                rows.append((a.key, int(a.count), a.self_cpu_time_total / 1e3))
        elif str(getattr(a, "device_type", "")).endswith("CUDA") and not getattr(a, "is_user_annotation", False):
            if a.key in RANGES:
                continue
            us = getattr(a, "self_device_time_total", None)
            us = getattr(a, "self_cuda_time_total", 0.0) if us is None else us
            rows.append((a.key, int(a.count), us / 1e3))
    return sorted(rows, key=lambda r: -r[2])


def kernel_summary(prof, device: str, top: int = 8) -> dict:
    """``kernels``, their summed ``device_ms``, ``ours_ms`` (quantmla's kernels; CUDA only) and the ``top_kernels``."""
    ks = device_kernels(prof, device)
    out = {"kernels": sum(k[1] for k in ks), "device_ms": sum(k[2] for k in ks),
           "top_kernels": [(k[0][:80], k[1], round(k[2], 3)) for k in ks[:top]]}  # fmt: skip
    if device == "cuda":
        out["ours_ms"] = sum(k[2] for k in ks if any(o in k[0] for o in OURS))
    return out


def range_times(events) -> dict[str, dict]:
    """Per range of :data:`RANGES` that ran: calls, host ``cpu_ms`` and the ``device_ms`` of the kernels launched
    inside it (0 on a CPU run), each summed over its calls."""
    out: dict[str, dict] = {}
    for e in events:
        if e.name in RANGES and str(e.device_type).endswith("CPU"):  # the host side; its device span is left out
            r = out.setdefault(e.name, {"calls": 0, "cpu_ms": 0.0, "device_ms": 0.0})
            r["calls"] += 1
            r["cpu_ms"] += e.cpu_time_total / 1e3
            r["device_ms"] += e.device_time_total / 1e3
    return {k: {**v, "cpu_ms": round(v["cpu_ms"], 3), "device_ms": round(v["device_ms"], 3)} for k, v in out.items()}


@contextlib.contextmanager
def module_ranges(model):
    """A profiler range ``model.<name>`` around every submodule called ``*.<name>`` for ``name`` in :data:`MODULES`
    (each decoder layer's attention and MLP: transformers' own attention for ``hf``, the absorbed one otherwise)."""
    handles = []
    for name, mod in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in MODULES:
            opened: list = []

            def enter(m, args, label=f"model.{kind}", opened=opened) -> None:
                opened.append(torch.profiler.record_function(label))
                opened[-1].__enter__()

            def leave(m, args, out, opened=opened) -> None:
                opened.pop().__exit__(None, None, None)

            handles += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def profiled(model, run, device: str):
    """``run()`` once under ``torch.profiler`` (host operators; device kernels on CUDA) with :func:`module_ranges`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with module_ranges(model), profile(activities=acts) as prof:
        run()
        bg.sync(device)
    return prof


def profile_format(model, fmt: str, batch: int, n: int, steps: int, device: str) -> dict:
    from quantmla.mla.spec import MLASpec

    cache = bg.new_cache(model, fmt, n + steps + 3)
    bg.fill(cache, MLASpec.from_config(model.config), batch, n, device, model.dtype)
    ids = [torch.randint(0, model.config.vocab_size, (batch, 1), device=device)]

    def step() -> None:
        ids[0] = bg.forward(model, ids[0], cache).argmax(-1, keepdim=True)

    wall = bg.median_seconds(step, steps, 1, device)
    prof = profiled(model, step, device)
    ops = top_level_ops(prof.events())
    row = {"format": fmt, "batch": batch, "context": n, "wall_ms": 1e3 * wall,
           "cpu_ops": sum(ops.values()), "top_ops": ops.most_common(8)}  # fmt: skip
    if device == "cuda":
        ks = kernel_summary(prof, device)
        row.update(gpu_ms=ks.pop("device_ms"), **ks)
    return {**row, "ranges": range_times(prof.events())}


def profile_prefill(model, fmt: str, n: int, chunk: int, steps: int, device: str) -> dict:
    """One ``n``-token prompt (batch 1) into a fresh cache per ingestion, in forwards of ``chunk`` tokens: one warm-up,
    ``steps`` timed (median), one profiled; ``cached_tokens``: the distinct per-layer lengths it left in the cache."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
    box: list = []  # the last ingestion's cache and chunk seconds

    def run() -> None:
        box.clear()  # the previous cache goes before the next is made
        cache = bg.new_cache(model, fmt, n + 1)
        box.extend([cache, bg.ingest(model, ids, cache, chunk, device)])

    wall = bg.median_seconds(run, steps, 1, device)
    chunk_s = box[1]
    prof = profiled(model, run, device)
    lengths = sorted({box[0].get_seq_length(i) for i in range(model.config.num_hidden_layers)})
    box.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    ops = top_level_ops(prof.events())
    return {"format": fmt, "batch": 1, "context": n, "chunk": chunk or n, "wall_s": wall,
            "chunk_s": [round(t, 4) for t in chunk_s], "cached_tokens": lengths, "cpu_ops": sum(ops.values()),
            **kernel_summary(prof, device, top=12), "ranges": range_times(prof.events()),
            "top_ops": ops.most_common(12)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v2-lite", help="v2-lite, smollm2-mla or tiny")
    ap.add_argument("--formats", default="hf,bf16,c4r4")
    ap.add_argument("--batch", type=int, default=32, help="decode batch (--prefill: always 1)")
    ap.add_argument("--context", type=bg._ints, default=[32768], help="tokens cached before the step (decode) or "
                    "the prompt's length (--prefill); comma-separated for several")  # fmt: skip
    ap.add_argument("--steps", type=int, default=5, help="timed steps / ingestions (median)")
    ap.add_argument("--prefill", action="store_true", help="profile one prompt's ingestion, not a decode step")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="--prefill: forwards of this many tokens "
                    "(0: the whole prompt in one)")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: decode batch 2 x context 64; "
                    "--prefill a 300-token prompt in chunks of 128")  # fmt: skip
    add_output_args(ap, tag=None)  # default tag: <model>_b<batch>_n<context> / <model>_prefill_n<context>_c<chunk>
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.batch, args.context, args.steps, args.device = "tiny", 2, [64], 2, "cpu"
        if args.prefill:
            args.context, args.prefill_chunk = [300], 128
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is available (use --device cpu or --smoke)")
    ctx = "-".join(map(str, args.context))
    if args.smoke:
        tag = args.tag or ("smoke_prefill" if args.prefill else "smoke")
    else:
        tag = args.tag or (f"{args.model}_prefill_n{ctx}_c{args.prefill_chunk}" if args.prefill
                           else f"{args.model}_b{args.batch}_n{ctx}")  # fmt: skip
    stem = result_stem(args.out, "step_profile", tag, args.force)
    model, desc = bg.build_model(args.model, args.device)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"device": device, "date": date, "commit": commit_id(), "command": " ".join(sys.argv if argv is None
            else ["benchmarks/step_profile.py", *argv]), "model": desc, "layers": model.config.num_hidden_layers,
            "mode": "prefill" if args.prefill else "decode", "clock": "GPU" if args.device == "cuda" else "CPU",
            "torch": torch.__version__}  # fmt: skip
    rows = []
    for n in args.context:
        for fmt in args.formats.split(","):
            if args.prefill:
                rows.append(profile_prefill(model, fmt, n, args.prefill_chunk, args.steps, args.device))
            else:
                rows.append(profile_format(model, fmt, args.batch, n, args.steps, args.device))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("top_")}), flush=True)
            (write_prefill if args.prefill else write)(stem, meta, rows)
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
        at = f"{r['format']} B{r['batch']} x {r['context']}"
        lines += ["", f"{at}: most frequent operators {r['top_ops']}"]
        if gpu:
            lines.append(f"{at}: top kernels by device time (name, launches, ms) {r['top_kernels']}")
    write_results(stem, {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"})


def write_prefill(stem: str, meta: dict, rows: list[dict]) -> None:
    clk = meta["clock"]
    key = "device_ms" if clk == "GPU" else "cpu_ms"  # of a range: the kernels launched inside it / its host time
    what = ("`kernels` / `GPU ms` = device kernels of the profiled ingestion and their summed device time; `ours` = "
            "quantmla's writer/attention kernels; a range's ms = the device time of the kernels launched inside it"
            if clk == "GPU" else "`kernels` / `CPU ms` = aten operators and their self CPU time; a range's ms = the "
            "CPU time inside it")  # fmt: skip
    lines = [f"# Prompt ingestion profiled, {meta['device']}, {meta['date']}, commit {meta['commit']}", "",
             f"`{meta['command']}`: {meta['model']}, {meta['layers']} layers, torch {meta['torch']}. One prompt of "
             "`context` tokens (batch 1) in forwards of `chunk` tokens into a fresh cache. `wall` = median "
             "synchronized ingestion (outside the profiler, after one warm-up); `aten ops` = top-level operators "
             f"dispatched; {what}, nested ranges included (`attention` / `MLP`: every decoder layer's attention and "
             "MLP module; `prefill attn`, `store`, `mask`: inside our cache's attend, quantmla.cache.layer).", "",
             f"| format | context | chunk | wall s | aten ops | kernels | {clk} ms | ours ms | attention ms | MLP ms | "
             f"prefill attn ms | store ms | mask ms | {clk} / wall |", "|---" * 14 + "|"]  # fmt: skip
    for r in rows:
        ranges = [f"{r['ranges'][k][key]:.1f}" if k in r["ranges"] else "-" for k in RANGES]
        cells = [r["format"], r["context"], r["chunk"], f"{r['wall_s']:.3f}", r["cpu_ops"], r["kernels"],
                 f"{r['device_ms']:.1f}", f"{r['ours_ms']:.1f}" if "ours_ms" in r else "-", *ranges,
                 f"{r['device_ms'] / (1e3 * r['wall_s']):.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    for r in rows:
        at = f"{r['format']} x {r['context']}"
        spans = "; ".join(f"{k} {v['calls']}, {v['cpu_ms']:.1f}, {v[key]:.1f}" for k, v in r["ranges"].items())
        lines += ["", f"{at}: chunk seconds {r['chunk_s']}; cached tokens per layer {r['cached_tokens']}",
                  f"{at}: ranges (calls, host ms, {clk} ms) {spans}",
                  f"{at}: top kernels by {clk} time (name, launches, ms) {r['top_kernels']}",
                  f"{at}: most frequent operators {r['top_ops']}"]  # fmt: skip
    write_results(stem, {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
