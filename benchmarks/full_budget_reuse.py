"""``full_budget.py --reuse FILE``: the BF16 and RTN units of an earlier results file instead of computing them again.

Neither row has transforms, so no calibration setting and no ``--rope-rounding`` changes what they measure: a run
that only changes how the calibrated rows are rounded (``--rope-rounding rotated``) would spend ~14 of its ~77 GPU
minutes (H200, full_budget_paper.json: BF16 and RTN retrieval 55-226 s a unit) recomputing numbers it already has.

A unit is reused only when the earlier file evaluated it the same way (corpora, tokens, window, retrieval tasks,
lengths and samples: anything else is a clear error, not a silent mix) and on the device this run uses (a table
mixes no devices' last bits); a unit of another device is computed here instead, and said so. Each reused unit
keeps its own seconds and device and names its source (``reused_from``: file, commit, date); the table says so
under its header (``full_budget_report.write``).
"""

from __future__ import annotations

import json
import os

REUSABLE_METHODS = (None, "rtn")  # the rows without transforms
SETTINGS = ("corpora", "ppl_tokens", "ppl_context", "tasks", "lengths", "samples")  # what their numbers depend on


def reusable_units(path: str, args, planned: list[dict], device: str) -> dict[str, dict]:
    """{key: unit} of ``path``'s BF16 / RTN units that ``planned`` (this run's units) holds and that were measured
    on ``device`` with this run's evaluation settings. Raises SystemExit naming the difference otherwise."""
    if not os.path.isfile(path):
        raise SystemExit(f"--reuse {path}: no such file (a full_budget_<tag>.json of an earlier run)")
    try:
        with open(path) as fh:
            data = json.load(fh)
        earlier, done = data["args"], data["units"]
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--reuse {path}: not a full_budget results file ({type(e).__name__}: {e})") from None
    for k in SETTINGS:
        if earlier.get(k) != getattr(args, k):
            raise SystemExit(f"--reuse {path}: it evaluated with {k} = {earlier.get(k)!r}, this run with "
                             f"{getattr(args, k)!r}; reuse only a run of the same evaluation settings")  # fmt: skip
    # a unit's own commit where it has one (since 2026-12-07); else the file's, which is its last call's: a table
    # built over several sessions holds older units (session 44: variant a's BF16 and C4R4 RTN units of
    # full_budget_paper.json, from an earlier session than its commit, differ from a run today in the 4th digit)
    source = {"file": os.path.basename(path), "commit": data.get("commit"), "date": data.get("date")}
    out, elsewhere = {}, []
    for u in planned:
        r = done.get(u["key"])
        if u["method"] not in REUSABLE_METHODS or r is None or "result" not in r:
            continue
        if r.get("device") != device:
            elsewhere.append(f"{u['key']} ({r.get('device')})")
            continue
        out[u["key"]] = {**r, "reused_from": {**source, "commit": r.get("commit", source["commit"])}}
    if elsewhere:
        print(f"--reuse {path}: measured on another device than {device}, computed here instead: "
              + ", ".join(elsewhere), flush=True)  # fmt: skip
    return out


def reuse_line(results: dict) -> str | None:
    """The table's sentence naming where its reused rows come from (None when none is)."""
    src = {}
    for r in results["units"].values():
        if r.get("reused_from"):
            s = r["reused_from"]
            src.setdefault((s["file"], s.get("commit"), s.get("date")), set()).add(
                "BF16" if r["method"] is None else str(r["method"]).upper())
    if not src:
        return None
    parts = [f"{' and '.join(sorted(rows))} from {f} (commit {c}, {d})" for (f, c, d), rows in sorted(src.items())]
    return ("Rows without transforms, which the RoPE rounding does not change, reused: " + "; ".join(parts) + ".")
