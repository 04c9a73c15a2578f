"""Time per output token with the decode step captured in a CUDA graph (``quantmla.cache.graph.CapturedDecode``)
against the eager step, per cache format, on ``bench_generate``'s models.

The eager step of the DeepSeek-V2-Lite-shaped model is bound by its launches (``step_profile.py``): 63-69 ms for
every format at B32 x 32K while its attention kernels take 6-9 ms. Replaying the captured step shows what the cache
formats change. Checked first, on a small batch: the captured step's greedy tokens and logits against the eager
step's on a copy of the same cache planned for the same capacity (tokens equal, logits within 1e-2 relative:
bf16 activations). Then, per format and shape, ``bench_generate.time_decode(graph=True)``: a cache of ``B x N``
random latents, ``--steps`` eager steps timed, the step captured, ``--steps`` replays timed (median, synchronized).

Writes ``graph_decode_<tag>.{json,md}`` to ``--out``. GPU only::

    PYTHONPATH=src python benchmarks/bench_graph_decode.py --model v2-lite --shapes 32x32768,8x131072 --tag h200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
from bench_prefill import commit_id  # noqa: E402 - the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
from quantmla.cache.graph import CapturedDecode, decode_step  # noqa: E402
from quantmla.mla.spec import MLASpec  # noqa: E402
from results_io import parse_gpu_args, write_results  # noqa: E402


def eager_step(model, cache, ids: torch.Tensor, position: int) -> torch.Tensor:
    with torch.no_grad():
        return decode_step(model, cache, ids, torch.tensor([position], device=ids.device)).float()


def check(model, fmt: str, B: int = 2, n: int = 300, steps: int = 8) -> dict:
    """Captured vs eager greedy steps on two copies of one prompt's cache, both planned for the same capacity."""
    spec = MLASpec.from_config(model.config)
    caches = []
    for _ in range(2):
        c = bg.new_cache(model, fmt, n + steps + 1)
        bg.fill(c, spec, B, n, "cuda", model.dtype, seed=5)
        caches.append(c)
    for i in range(len(caches[1].store.layouts)):
        caches[1].store.layer(i).planned_length = n + steps + 1
    graph = CapturedDecode(model, caches[0], max_length=n + steps + 1)
    tok_g = tok_e = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    worst, same = 0.0, True
    for s in range(steps):
        lg, le = graph.step(tok_g), eager_step(model, caches[1], tok_e, n + s)
        worst = max(worst, float((lg - le).norm() / le.norm()))
        tok_g, tok_e = lg.argmax(-1, keepdim=True), le.argmax(-1, keepdim=True)
        same &= bool(torch.equal(tok_g, tok_e))
    return {"format": fmt, "rel_logits": worst, "tokens_equal": same, "ok": same and worst <= 1e-2}


def time_format(model, fmt: str, B: int, n: int, steps: int) -> dict:
    """bench_generate's eager and captured time per token of one shape, as this table's row."""
    r = bg.time_decode(model, fmt, B, n, steps, 1, "cuda", graph=True)
    return {"format": fmt, "batch": B, "context": n, "eager_ms": r["tpot_ms"], "graph_ms": r["graph_tpot_ms"],
            "speedup": r["tpot_ms"] / r["graph_tpot_ms"], "capture_s": r["capture_s"], "tok_s": r["graph_tok_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="v2-lite", help="v2-lite, smollm2-mla or tiny")
    ap.add_argument("--formats", default="bf16,c8r8,c4r4,c2r4")
    ap.add_argument("--shapes", default="32x32768,8x131072,1x4096", help="BxN,...")
    ap.add_argument("--steps", type=int, default=8)
    args, stem = parse_gpu_args(ap, "graph_decode", "bench_graph_decode.py captures CUDA graphs")
    model, desc = bg.build_model(args.model, "cuda")
    formats = args.formats.split(",")
    checks = [check(model, f) for f in formats]
    for c in checks:
        print(json.dumps(c), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        B, n = (int(v) for v in shape.split("x"))
        for fmt in formats:
            ok, gib = bg.fits(model, fmt, B, n, "cuda")
            if not ok:
                print(f"{fmt} {B}x{n}: needs {gib:.1f} GiB, skipped", flush=True)
                continue
            rows.append(time_format(model, fmt, B, n, args.steps))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes")
    meta = {"device": torch.cuda.get_device_name(), "date": date, "commit": commit_id(), "command": " ".join(sys.argv),
            "model": desc, "ok": all(c["ok"] for c in checks)}  # fmt: skip
    write(stem, meta, checks, rows)
    print(json.dumps({"ok": meta["ok"], "rows": len(rows)}))
    return 0 if meta["ok"] else 1


def write(stem: str, meta: dict, checks: list[dict], rows: list[dict]) -> None:
    lines = [f"# Decode step captured in a CUDA graph vs eager, {meta['device']}, {meta['date']}, commit "
             f"{meta['commit']}", "", f"`{meta['command']}`: {meta['model']}; median of synchronized steps.", "",
             "Check (captured vs eager on copies of one cache, 8 greedy steps): "
             + ", ".join(f"{c['format']} {'tokens equal' if c['tokens_equal'] else 'TOKENS DIFFER'}, logits rel "
                         f"{c['rel_logits']:.1e}" for c in checks) + ".", "",
             "| format | B x context | eager ms | captured ms | speed-up | captured tokens/s | captured vs bf16 |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    base = {(r["batch"], r["context"]): r["graph_ms"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        ref = base.get((r["batch"], r["context"]))
        vs = f"{r['graph_ms'] / ref:.2f}x" if ref else "-"
        lines.append(f"| {r['format']} | {r['batch']} x {r['context']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} "
                     f"| {r['speedup']:.2f}x | {r['tok_s']:.0f} | {vs} |")  # fmt: skip
    doc = {"meta": meta, "checks": checks, "rows": rows}
    write_results(stem, {".json": json.dumps(doc, indent=1), ".md": "\n".join(lines) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
