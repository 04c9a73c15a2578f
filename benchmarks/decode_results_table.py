"""Merge the H200 decode runs into one table whose split counts match the shipped heuristic.

Run A (``decode_h200.json``: at most 4 programs per SM, at least 4 pages per split) and run B
(``decode_h200_minpages16.json``: at least 16 pages per split) differ only in the split-K factor. For every
(batch, context) this picks the run whose split count equals what ``default_num_splits`` now chooses and writes
``decode_h200_final.md`` (column ``run``). Usage: ``python benchmarks/decode_results_table.py``
"""

from __future__ import annotations

import json
import math
import os

import torch

from quantmla.kernels import triton_decode as td

HERE = os.path.join(os.path.dirname(__file__), "results")
FLASHMLA_US = {(32, 32768): 326.0, (32, 131072): 1170.0, (8, 131072): 330.0, (1, 131072): 102.0}


def splits(batch: int, context: int, waves: float, min_pages: int, sms: int = 132) -> int:
    mp = math.ceil(context / 64)
    ns = max(1, min(math.ceil(waves * sms / batch), math.ceil(mp / min_pages), mp))
    return math.ceil(mp / math.ceil(mp / ns))


def final_splits(batch: int, context: int) -> int:
    td._SM_COUNT[0] = 132
    mp = math.ceil(context / 64)
    ns = max(1, min(td.default_num_splits(batch, mp, torch.device("cuda", 0)), mp))
    return math.ceil(mp / math.ceil(mp / ns))


def main() -> None:
    runs = {}
    for tag, path, min_pages in (("A", "decode_h200.json", 4), ("B", "decode_h200_minpages16.json", 16)):
        with open(os.path.join(HERE, path)) as f:
            runs[tag] = (json.load(f), min_pages)
    meta_a = runs["A"][0]["meta"]
    rows = {}
    for tag, (data, min_pages) in runs.items():
        for r in data["rows"]:
            rows[(tag, r["batch"], r["context"], r["impl"])] = (r, splits(r["batch"], r["context"], 4.0, min_pages))
    keys = sorted({(b, n) for (_, b, n, _) in rows}, key=lambda k: (k[0], k[1]))
    impls = ["bf16", "c8r8", "c4r8", "c4r4", "c2r4", "torch"]
    lines = [
        f"# Decode attention, {meta_a['device']}, {meta_a['date'][:10]} (runs A: commit {meta_a['commit']}, "
        f"B: commit {runs['B'][0]['meta']['commit']})",
        "",
        "Median latency in microseconds (CUDA-graph replay after an L2 flush, 20 repetitions), DeepSeek-V2-Lite "
        "shapes (16 heads, latent 512, RoPE 64), page 64, sink 4 / local 128, shuffled block tables. Per row, the "
        "run whose split-K factor equals the shipped heuristic (`run`; `~` = heuristic picks a factor neither run "
        f"measured, B shown). Copy bandwidth measured in the runs: {meta_a['copy_gbps']:.0f} GB/s. `GB/s` columns: "
        "effective cache bytes / time. torch = plain PyTorch absorbed attention over a dense BF16 cache.",
        "",
        "| batch | context | run | splits | "
        + " | ".join(f"{i} us" for i in impls)
        + " | bf16 GB/s | c4r4 GB/s | c4r4 x BF16 | c2r4 x BF16 | FlashMLA us |",
        "|" + "---|" * (4 + len(impls) + 5),
    ]
    for b, n in keys:
        want = final_splits(b, n)
        tag = next((t for t in ("A", "B") if rows[(t, b, n, "bf16")][1] == want), None)
        src = tag or "B"
        get = lambda i, src=src, b=b, n=n: rows[(src, b, n, i)][0]  # noqa: E731
        us = [get(i)["us"] for i in impls]
        lines.append(
            f"| {b} | {n} | {tag or '~'} | {want} | "
            + " | ".join(f"{u:.1f}" for u in us)
            + f" | {get('bf16')['gbps']:.0f} | {get('c4r4')['gbps']:.0f} | {us[0] / us[3]:.2f} | {us[0] / us[4]:.2f} "
            f"| {FLASHMLA_US.get((b, n), '')} |"
        )
    with open(os.path.join(HERE, "decode_h200_final.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
