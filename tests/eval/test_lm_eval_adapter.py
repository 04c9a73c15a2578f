"""The lm-eval adapter on a tiny model: log-likelihoods match a direct computation; a tiny local task runs."""

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

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


def test_tiny_local_task_end_to_end(tiny_mla, tokenizer, tmp_path):
    """A two-choice task generated here (local JSON file), run through lm_eval.simple_evaluate."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _, mla = tiny_mla
    data = tmp_path / "colors.jsonl"
    rows = [
        {"q": "The sky is", "choices": [" blue.", " green."], "label": 0},
        {"q": "The grass is", "choices": [" blue.", " green."], "label": 1},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "colors.yaml").write_text(
        "task: quantmla_colors\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    lm = QuantMLALM(mla, tokenizer, cache_format="c4r4")
    try:
        res = simple_evaluate(model=lm, tasks=["quantmla_colors"], task_manager=TaskManager(include_path=str(tmp_path)))
    except Exception as e:  # the datasets json builder needs no network, but some installs lack pieces
        pytest.skip(f"lm_eval could not build the local task here: {type(e).__name__}: {e}")
    acc = res["results"]["quantmla_colors"]["acc,none"]
    assert 0.0 <= acc <= 1.0
