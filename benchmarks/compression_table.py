"""Physical cache bytes of every format for DeepSeek-V2-Lite and DeepSeek-V3 shapes at 4K-1M context.

Computed (not timed): packed store at page granularity + BF16 sink/local buffers + scales/offsets +
block table, via :func:`quantmla.quant.formats.cache_bytes`. Writes
``benchmarks/results/compression.{json,md}``.

    python benchmarks/compression_table.py
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess

from quantmla.presets import PRESETS, cache_dims
from quantmla.quant.formats import FORMATS, CachePolicy, cache_bytes

CONTEXTS = {"4K": 4096, "32K": 32768, "128K": 131072, "1M": 1048576}
MODELS = ("deepseek-v2-lite", "deepseek-v3")


def main() -> None:
    policy = CachePolicy()
    rows = []
    for m in MODELS:
        dc, dr, layers = cache_dims(PRESETS[m])
        for label, ctx in CONTEXTS.items():
            base = cache_bytes("bf16", kv_lora_rank=dc, rope_dim=dr, num_layers=layers, context=ctx, policy=policy)
            for name in FORMATS:
                b = cache_bytes(name, kv_lora_rank=dc, rope_dim=dr, num_layers=layers, context=ctx, policy=policy)
                rows.append(
                    {
                        "model": m,
                        "context": label,
                        "format": name,
                        "bytes": b.total,
                        "gib": b.total / 2**30,
                        "compression": base.total / b.total,
                    }
                )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "device": "n/a (computed byte count)",
        "policy": {"sink": policy.sink, "local": policy.local, "page_size": policy.page_size},
        "batch": 1,
    }
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compression.json.tmp"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    os.replace(os.path.join(out, "compression.json.tmp"), os.path.join(out, "compression.json"))
    lines = [
        f"# Cache bytes per sequence (batch 1), sink 4 / local 128, page 64 — {meta['date']}, commit {commit}",
        "",
        "GiB per sequence (compression vs BF16).",
        "",
    ]
    for m in MODELS:
        lines += [f"## {m}", "", "| format | " + " | ".join(CONTEXTS) + " |", "|---" * (len(CONTEXTS) + 1) + "|"]
        for name in FORMATS:
            mine = [r for r in rows if r["model"] == m and r["format"] == name]
            cells = [f"{r['gib']:.3f} ({r['compression']:.2f}x)" for r in mine]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    with open(os.path.join(out, "compression.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
