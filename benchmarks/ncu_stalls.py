"""Where a kernel's warps stall, from ncu's per-SASS-instruction samples: one markdown table per profile.

    ncu --set full -o prof python benchmarks/profile_decode.py c4r4 32 32768      # the GPU (gpu_next_calls.sh ncu)
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof_sass.csv
    python benchmarks/ncu_stalls.py before=a_sass.csv after=b_sass.csv --out benchmarks/results/ncu_x.md

Per profile: the stall reasons' shares of all samples, the SASS instructions executed per warp and tile of the main
loop (instructions executed at least ``--loop-min`` times per warp are the loop; the most executed one gives the
tile count), and the opcodes with the most samples and their top reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from pathlib import Path


def summarize(path: Path, loop_min: int) -> dict:
    rows = list(csv.reader(path.open()))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[head], rows[head + 1 :]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    total, by_op, loop_exec, regions = collections.Counter(), {}, collections.Counter(), collections.Counter()
    samples = 0
    tiles = max(int(r[ix["Instructions Executed"]] or 0) for r in data)
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[ix["Source"]].strip()).split(" ")[0]
        n, e = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0), int(r[ix["Instructions Executed"]] or 0)
        samples += n
        regions["loop" if e >= loop_min else "outside the loop"] += n
        c = by_op.setdefault(op, collections.Counter())
        for h in reasons:
            v = int(r[ix[h]] or 0)
            total[h] += v
            c[h] += v
        if e >= loop_min:
            loop_exec[op] += e / tiles
    return {"samples": samples, "total": total, "by_op": by_op, "loop_exec": loop_exec, "regions": regions,
            "tiles": tiles}  # fmt: skip


def table(name: str, s: dict, top: int) -> list[str]:
    S = max(s["samples"], 1)
    out = [f"## {name}", "",
           f"{s['samples']} samples; " + ", ".join(f"{k} {100 * v / S:.1f}%" for k, v in s["regions"].items())
           + f"; main loop: {sum(s['loop_exec'].values()):.0f} SASS instructions per warp and tile", "",
           "| stall reason | share |", "|---|---|"]  # fmt: skip
    out += [f"| {k[6:]} | {100 * v / S:.1f}% |" for k, v in s["total"].most_common() if v]
    out += ["", "| opcode | samples | per warp-tile (loop) | top reasons |", "|---|---|---|---|"]
    ops = sorted(s["by_op"].items(), key=lambda kv: -sum(kv[1].values()))[:top]
    for op, c in ops:
        why = ", ".join(f"{k[6:]} {v}" for k, v in c.most_common(3) if v)
        out.append(f"| {op} | {100 * sum(c.values()) / S:.1f}% | {s['loop_exec'].get(op, 0):.0f} | {why} |")
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", help="NAME=PATH of an ncu --page source --csv export")
    ap.add_argument("--out", required=True, help="markdown file to write")
    ap.add_argument("--title", default="ncu stall samples per SASS instruction")
    ap.add_argument("--loop-min", type=int, default=60000, help="executions per warp that mark the main loop")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--force", action="store_true", help="overwrite --out")
    a = ap.parse_args()
    out = Path(a.out)
    if out.exists() and not a.force:
        raise SystemExit(f"{out} exists: pass --force to overwrite it")
    lines = [f"# {a.title}", ""]
    for spec in a.profiles:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{spec!r}: expected NAME=PATH")
        lines += table(name, summarize(Path(path), a.loop_min), a.top)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
