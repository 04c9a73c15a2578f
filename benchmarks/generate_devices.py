"""Same greedy tokens on the CPU and on CUDA? QuantMLACache through the torch references vs through the kernels.

For each format and prompt, the model (fp32 weights on both devices, absorbed attention over a ``QuantMLACache``
with a 16-token local window, so that most of the context is read from the packed pages)
generates ``--steps`` greedy tokens on the CPU (the fp32 torch reference of the paged layout) and on CUDA (fused
writer, fused prefill attention, decode kernels). Reported per run: whether the token sequences are identical,
and, teacher-forcing the CUDA run on the CPU's tokens, every step where the two devices pick a different token,
with the CPU's logit margin there (top-1 minus top-2) against the largest logit difference between the devices
at that step: a flip is a rounding decision when the margin is below that difference. Also the largest logit
difference over all steps (the kernels' error as the model sees it).

Writes ``generate_devices_<tag>.{json,md}`` to ``--out``. On the GPU machine::

    PYTHONPATH=src python benchmarks/generate_devices.py --model smollm2-mla --tag h200
    PYTHONPATH=src python benchmarks/generate_devices.py --tiny --devices cpu,cpu --out /tmp/dev   # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys

import torch

from quantmla.cache.hf import QuantMLACache
from quantmla.compat import with_cache
from quantmla.mla.attention import enable_absorbed_attention
from quantmla.quant.formats import CachePolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import gpu_tag  # noqa: E402 - the default tag: the GPU model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a kingdom by the sea, there lived",
    "Water boils at 100 degrees Celsius at sea level because",
]


@torch.no_grad()
def run(model, ids: torch.Tensor, fmt: str, policy: CachePolicy, steps: int, feed: list[int] | None = None):
    """Greedy (or teacher-forced on ``feed``) steps: (tokens [steps], logits [steps, V] fp32 on the CPU)."""
    cache = QuantMLACache(model.config, fmt, policy, max_length=ids.shape[1] + steps)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **with_cache(cache)).logits[0, -1].float()
    toks, out = [], []
    for s in range(steps):
        out.append(logits.cpu())
        toks.append(int(logits.argmax()) if feed is None else feed[s])
        nxt = torch.tensor([[toks[-1]]], device=ids.device)
        logits = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **with_cache(cache)).logits[0, -1].float()
    return toks, torch.stack(out)


def compare(models: dict, ids: torch.Tensor, fmt: str, policy: CachePolicy, steps: int) -> dict:
    (da, ma), (db, mb) = ((k.split("#")[0], m) for k, m in models.items())
    ta, la = run(ma, ids.to(da), fmt, policy, steps)
    tb, _ = run(mb, ids.to(db), fmt, policy, steps)
    _, lb = run(mb, ids.to(db), fmt, policy, steps, feed=ta)  # teacher-forced on the first device's tokens
    diff = (lb - la).abs()  # [steps, V]
    flips = []
    for s in range(steps):
        if int(lb[s].argmax()) != ta[s]:
            top2 = la[s].topk(2).values
            flips.append({"step": s, "margin": float(top2[0] - top2[1]), "max_logit_diff": float(diff[s].max()),
                          "rounding": bool(top2[0] - top2[1] <= 2 * diff[s].max())})  # fmt: skip
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    return {"format": fmt, "identical": ta == tb, "first_divergence": first, "flips": flips,
            "max_logit_diff": float(diff.max()), "rel_l2": float((lb - la).norm() / la.norm())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-mla")
    ap.add_argument("--formats", default="bf16,c8r8,c4r4,c2r4")
    ap.add_argument("--devices", default="cpu,cuda", help="the two devices compared")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sink", type=int, default=4, help="sink tokens kept in BF16 (default %(default)s)")
    ap.add_argument("--local", type=int, default=16,
                    help="local-window tokens kept in BF16 (default %(default)s: short, so the prompts and the "
                         "generated tokens are mostly read from the packed pages)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model, 8 steps (smoke run)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",")]
    tag = args.tag or ("tiny" if args.tiny else gpu_tag())
    base = os.path.join(args.out, f"generate_devices_{tag}")
    if os.path.exists(base + ".json") and not args.force:
        raise SystemExit(f"error: {base}.json exists; pass --force or another --tag")
    if args.tiny:
        from quantmla.mla.tiny import tiny_model

        m0, tok, steps = tiny_model("deepseek_v3", first_k_dense_replace=99), None, min(args.steps, 8)
        prompts = [torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (150, 40)]
    else:
        from quantmla.models.names import resolve_model

        m0, tok, _ = resolve_model(args.model, "float32")
        steps = args.steps
        prompts = [tok(p, return_tensors="pt").input_ids for p in PROMPTS]
    import copy

    models = {}
    for i, d in enumerate(devices):
        m = (m0 if i == 0 else copy.deepcopy(m0)).to(d).eval()
        models[f"{d}#{i}"] = enable_absorbed_attention(m)
    # a short local window: the prompts (~15 tokens) + 64 steps stay inside the default sink + local window (132
    # BF16 tokens), where no packed byte is ever read; with local 16 most of the context is read from the pages
    policy = CachePolicy(sink=args.sink, local=args.local)
    rows = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        for p, ids in enumerate(prompts):
            r = {"prompt": p, "prompt_tokens": ids.shape[1], **compare(models, ids, fmt, policy, steps)}
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    cmd = " ".join(["python", "benchmarks/generate_devices.py", *(sys.argv[1:] if argv is None else argv)])
    commit = os.environ.get("QUANTMLA_COMMIT") or subprocess.run(  # the GPU machine's tree may have no .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    meta = {"devices": devices, "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit or "unknown",
            "model": "tiny" if args.tiny else args.model, "steps": steps, "policy": vars(policy),
            "command": cmd}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(base + ".json.tmp", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    md = [f"# Greedy tokens, {devices[0]} vs {devices[1]}: {meta['model']}, {steps} steps, {meta['device_name']}, "
          f"{meta['date']}, commit {meta['commit']}", "", f"Command: `{meta['command']}`", "",
          f"Policy: sink {policy.sink}, local window {policy.local} (tokens outside both are read from the packed "
          f"pages).", "",
          "| format | prompt | identical | first divergence | flips (step: margin / logit diff) | max logit diff |",
          "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        fl = "; ".join(f"{x['step']}: {x['margin']:.3g} / {x['max_logit_diff']:.3g}" for x in r["flips"]) or "-"
        md.append(f"| {r['format']} | {r['prompt']} | {r['identical']} | {r['first_divergence']} | {fl} | "
                  f"{r['max_logit_diff']:.3g} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    ok = all(r["identical"] or all(x["rounding"] for x in r["flips"]) for r in rows)
    print(json.dumps({"runs": len(rows), "identical": sum(r["identical"] for r in rows), "explained": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
