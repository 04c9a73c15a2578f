"""Whole-job time of a scheduler trace, as a model: a sum of per-step costs.

A serving step (one forward pass of vLLM's scheduler output) costs, for one model on one device::

    step_s = step_overhead_s                              # weights read once per step, launches
           + per_token_s            * tokens              # dense work per scheduled token (all layers)
           + prefill_pair_s         * prefill_pairs       # prefill attention: sum over prefill queries of the
                                                          #   positions each attends to
           + decode_ctx_token_s[f]  * decode_ctx_tokens   # decode attention: cached tokens read, format f

Only the last term must depend on the cache format (the bytes the decode kernel reads per cached token); the
format's other effect, fewer preemptions and so fewer recomputed prefill tokens, is in the trace itself.
Measured costs may also give a format its own first three terms (``format_overrides``: the prefill path of a
packed cache differs from BF16's; benchmarks/step_costs.py fits all four terms per format).
``StepCosts.from_json`` reads measured costs; :func:`placeholder_costs` are *not* measurements: they are
derived from our H200 decode-kernel results and rough FLOP rates and say so in their label.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

_SHARED = ("step_overhead_s", "per_token_s", "prefill_pair_s")


@dataclass(frozen=True)
class StepCosts:
    label: str
    assumptions: str
    step_overhead_s: float
    per_token_s: float
    prefill_pair_s: float
    decode_ctx_token_s: dict[str, float] = field(default_factory=dict)
    # format -> {"step_overhead_s" | "per_token_s" | "prefill_pair_s": seconds}, replacing the shared value
    format_overrides: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in _SHARED:
            if not getattr(self, k) >= 0:
                raise ValueError(f"StepCosts.{k} must be >= 0, got {getattr(self, k)!r}")
        if not self.decode_ctx_token_s:
            raise ValueError("StepCosts.decode_ctx_token_s must give a cost per cached token for each format")
        for fmt, over in self.format_overrides.items():
            for k, v in over.items():
                if k not in _SHARED:
                    raise ValueError(f"StepCosts.format_overrides[{fmt!r}]: unknown cost {k!r} (one of {_SHARED})")
                if not v >= 0:
                    raise ValueError(f"StepCosts.format_overrides[{fmt!r}][{k!r}] must be >= 0, got {v!r}")

    def cost(self, name: str, fmt: str) -> float:
        """``step_overhead_s``, ``per_token_s`` or ``prefill_pair_s`` of format ``fmt``."""
        return self.format_overrides.get(fmt.lower(), {}).get(name, getattr(self, name))

    def decode_cost(self, fmt: str) -> float:
        try:
            return self.decode_ctx_token_s[fmt.lower()]
        except KeyError:
            raise ValueError(f"no decode cost for format {fmt!r} (have {sorted(self.decode_ctx_token_s)})") from None

    def step_s(self, step: tuple[int, int, int, int], fmt: str) -> float:
        """``step`` = (tokens, prefill_pairs, decode_tokens, decode_ctx_tokens)."""
        tokens, pairs, _decode_tokens, decode_ctx = step
        return (self.cost("step_overhead_s", fmt) + self.cost("per_token_s", fmt) * tokens
                + self.cost("prefill_pair_s", fmt) * pairs + self.decode_cost(fmt) * decode_ctx)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> StepCosts:
        d = json.loads(Path(path).read_text())
        missing = {"label", "assumptions", "step_overhead_s", "per_token_s", "prefill_pair_s",
                   "decode_ctx_token_s"} - set(d)
        if missing:
            raise ValueError(f"{path}: per-step cost file lacks {sorted(missing)} (see quantmla.serve.throughput)")
        return cls(**{k: d[k] for k in d if k in cls.__dataclass_fields__})


def job_time(trace: list[tuple[int, int, int, int]], costs: StepCosts, fmt: str, output_tokens: int):
    """(elapsed seconds, output tokens per second) of a whole job."""
    elapsed = sum(costs.step_s(s, fmt) for s in trace)
    return elapsed, (output_tokens / elapsed if elapsed > 0 else float("inf"))


# Decode attention per cached token and layer on the H200, DeepSeek-V2-Lite heads, batch 8 x 131072
# (benchmarks/results/decode_h200_final.md: bf16 328.7 us, c8r8 921.2, c4r4 850.8, c2r4 806.9).
_H200_DECODE_US_B8_128K = {"bf16": 328.7, "c8r8": 921.2, "c4r4": 850.8, "c2r4": 806.9}


def placeholder_costs(num_layers: int = 27) -> StepCosts:
    per_ctx = {f: us * 1e-6 / (8 * 131072) * num_layers for f, us in _H200_DECODE_US_B8_128K.items()}
    return StepCosts(
        label="PLACEHOLDER (not measured end to end): decode attention from our H200 kernel results, the rest "
        "from rough rates",
        assumptions="One H200, DeepSeek-V2-Lite. Decode attention per cached token = our Triton kernels at batch 8 x "
        "128K (decode_h200_final.md; our packed kernels are still slower than BF16 per step). Dense work 1e-5 s per "
        "token (2.4B active parameters at ~480 TFLOP/s), 8 ms per step to read 31 GB of weights at ~4 TB/s, prefill "
        "attention 7e-13 s per (query, key) pair (27 layers x 16 heads x 192+128 dims, ~400 TFLOP/s). Replace with "
        "measured costs: --costs FILE.",
        step_overhead_s=8e-3,
        per_token_s=1e-5,
        prefill_pair_s=7e-13,
        decode_ctx_token_s=per_ctx,
    )
