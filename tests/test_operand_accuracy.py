"""``benchmarks/operand_accuracy.py`` on a tiny random MLA model: the simulated operand rounding reaches every
attention call of the scored model through the cache (and nothing else changes outside the context), and the report
has a row name for every scheme (a scheme without one crashed the report after its rows were computed)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from benchutil import load_benchmark

CONTEXT = 128


def _module():
    return load_benchmark("operand_accuracy")


@pytest.fixture(scope="module")
def setup():
    from quantmla.eval.perplexity import reference_logprobs
    from quantmla.mla.tiny import tiny_model

    model = tiny_model("deepseek_v3")
    ids = torch.randint(0, model.config.vocab_size, (2 * CONTEXT,), generator=torch.Generator().manual_seed(0))
    ref = reference_logprobs(copy.deepcopy(model), ids, context=CONTEXT)
    return _module(), model, {"rand": (ids, ref)}


def test_rounding_reaches_every_attention_call_and_only_inside_the_context(setup):
    from quantmla.kernels.operand_rounding import simulated_operand_rounding

    mod, model, data = setup
    score = mod.score  # error_split's scoring, as the benchmark uses it
    plain = score(model, data, "c4r4", 4, 16, CONTEXT)["rand"]
    with simulated_operand_rounding("fp32", measure=True) as st:
        same = score(model, data, "c4r4", 4, 16, CONTEXT)["rand"]
    assert same == plain and st.summary()["calls"] == 0
    with simulated_operand_rounding("e4m3", measure=True) as st:
        fp8 = score(model, data, "c4r4", 4, 16, CONTEXT)["rand"]
    layers = model.config.num_hidden_layers
    assert st.summary()["calls"] == layers * 2  # every layer's attention, in each of the two windows
    assert fp8["kl"] != plain["kl"] and 1e-4 < st.summary()["median"] < 0.2
    assert score(model, data, "c4r4", 4, 16, CONTEXT)["rand"] == plain  # the context is gone


def test_report_names_every_scheme(setup, tmp_path):
    from quantmla.kernels.operand_rounding import SCHEMES

    mod, _, _ = setup
    assert set(mod.SCHEME_NAMES) == set(SCHEMES)
    one = {"ppl": 10.0, "kl": 1e-3, "top1": 0.9}
    rows = [{"cache": c, "scheme": s, "rand": one, "attention_rel_l2": {"calls": 1, "median": 1e-3, "max": 2e-3}}
            for c in ("c4r4", "bf16") for s in SCHEMES]  # fmt: skip
    res = {"rows": rows, "corpora": ["rand"], "tokens": 256, "context": 128, "transforms": {"file": "f", "label": "l"}}
    stem = str(tmp_path / "operand_accuracy_t")
    mod.write(res, stem, SimpleNamespace(command="python benchmarks/operand_accuracy.py"))
    md = open(stem + ".md").read()
    assert all(f"| {mod.SCHEME_NAMES[s]} |" in md for s in SCHEMES)
    assert len(json.load(open(stem + ".json"))["rows"]) == 2 * len(SCHEMES)
