"""The lm-eval adapter on a tiny model: log-likelihoods match a direct computation; a tiny local task scores what
a direct computation says it must.

lm_eval is part of the install (the ``eval`` extra, installed by scripts/install.sh and so in CI): these tests
must run, not vanish, so a missing lm_eval is a failure here, not a skip."""

import json

import pytest
import torch

try:
    import lm_eval  # noqa: F401
except ImportError:  # pragma: no cover - only where the eval extra is missing
    pytest.fail("lm_eval is not installed: pip install -e '.[eval]' (scripts/install.sh installs it)", pytrace=False)

from lm_eval.api.instance import Instance  # noqa: E402

from quantmla.eval.lm_eval_adapter import QuantMLALM  # noqa: E402


def _inst(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def test_loglikelihood_matches_direct(tiny_mla, tokenizer):
    src, mla = tiny_mla
    lm = QuantMLALM(mla, tokenizer, cache_format="fp32")
    ((ll, greedy),) = lm.loglikelihood([_inst("loglikelihood", ("The sky is", " blue."))])
    ctx, cont = tokenizer("The sky is")["input_ids"], tokenizer(" blue.")["input_ids"]
    with torch.no_grad():
        logits = mla(torch.tensor([ctx + cont])).logits[0].log_softmax(-1)
    ref = sum(float(logits[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert ll == pytest.approx(ref, abs=1e-3) and isinstance(greedy, bool)
    lm8 = QuantMLALM(mla, tokenizer, cache_format="c8r8", sink=0, local=0)
    ((ll8, _),) = lm8.loglikelihood([_inst("loglikelihood", ("The sky is", " blue."))])
    assert ll8 == pytest.approx(ll, abs=0.05)


def test_rolling_and_generate(tiny_mla, tokenizer):
    _, mla = tiny_mla
    lm = QuantMLALM(mla, tokenizer, cache_format="c4r4", max_length=16)
    (r,) = lm.loglikelihood_rolling([_inst("loglikelihood_rolling", ("The grass is green. The sky is blue.",))])
    assert r < 0
    (g,) = lm.generate_until([_inst("generate_until", ("The pass key is", {"until": ["."], "max_gen_toks": 5}))])
    assert isinstance(g, str) and "." not in g


def _direct_loglik(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) in float64 from one plain forward pass (no cache, no adapter)."""
    ctx, cont = tokenizer(context)["input_ids"], tokenizer(continuation)["input_ids"]
    with torch.no_grad():
        lp = model(torch.tensor([ctx + cont])).logits[0].double().log_softmax(-1)
    return float(sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def test_tiny_local_task_end_to_end(tiny_mla, tokenizer, tmp_path):
    """A three-choice task generated here (local JSON file) through lm_eval.simple_evaluate. Each label is set,
    from a direct float64 computation, to the most likely choice for 4 documents and the least likely for 2, so
    the accuracy lm_eval reports must be exactly 4/6 (a broken adapter, a wrong continuation split or a swapped
    sign gives another number)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _, mla = tiny_mla
    questions = ["The sky is", "The grass is", "The sun is", "The pass key is", "To be, or not", "Here we go"]
    words = [" blue.", " sky.", " grass.", " key."]  # two tokens each: the ranking is the model's, not the length's
    assert {len(tokenizer(w)["input_ids"]) for w in words} == {2}
    rows = []
    for i, q in enumerate(questions):
        choices = [words[(i + k) % 4] for k in range(3)]  # the order varies from document to document
        ll = [_direct_loglik(mla, tokenizer, q, c) for c in choices]
        order = sorted(range(3), key=lambda k: ll[k])
        assert ll[order[2]] - ll[order[1]] > 1e-3 and ll[order[1]] - ll[order[0]] > 1e-3  # no near-ties
        rows.append({"q": q, "choices": choices, "label": order[2] if i not in (1, 4) else order[0]})
    for k in range(3):  # a degenerate adapter (all scores equal -> always choice k) cannot hit 4/6 by chance
        assert sum(r["label"] == k for r in rows) != 4
    data = tmp_path / "colors.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "colors.yaml").write_text(
        "task: quantmla_colors\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ntarget_delimiter: ''\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    lm = QuantMLALM(mla, tokenizer, cache_format="fp32")
    res = simple_evaluate(model=lm, tasks=["quantmla_colors"], task_manager=TaskManager(include_path=str(tmp_path)))
    assert res["results"]["quantmla_colors"]["acc,none"] == pytest.approx(4 / 6)
