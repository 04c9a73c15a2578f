"""Perplexity, retrieval and the harness on a tiny converted MLA model (CPU, offline)."""

import json
import math

import pytest
import torch

from quantmla.compat import with_cache
from quantmla.eval.harness import EvalConfig, evaluate, expand_tasks, format_table, write_result
from quantmla.eval.needle import NeedleBuilder
from quantmla.eval.perplexity import perplexity, reference_logprobs
from quantmla.eval.retrieval import run_samples, summarize
from quantmla.eval.runtime import CacheSpec, make_cache

IDS = torch.randint(0, 384, (3 * 64 + 5,), generator=torch.Generator().manual_seed(4))


def test_perplexity_matches_manual_loss(tiny_mla):
    src, _ = tiny_mla
    r = perplexity(src, IDS, context=64, cache=CacheSpec("fp32"))
    assert r.windows == 3 and r.scored_tokens == 3 * 63
    nll = 0.0
    for w in range(3):
        x = IDS[w * 64 : (w + 1) * 64][None]
        with torch.no_grad():
            logits = src(x).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="sum"))
    assert r.nll == pytest.approx(nll / (3 * 63), rel=1e-5)
    assert r.perplexity == pytest.approx(math.exp(r.nll))


def test_kl_to_reference_is_zero_for_itself_and_matches_float64(tiny_mla):
    _, mla = tiny_mla
    ref = reference_logprobs(mla, IDS, context=64)  # [3, 64, V]
    assert ref.shape == (3, 64, mla.config.vocab_size)
    same = perplexity(mla, IDS, context=64, cache=CacheSpec("fp32"), reference=ref)
    assert same.kl_to_reference == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    got = perplexity(mla, IDS, context=64, cache=CacheSpec("c2r4", sink=0, local=0), reference=ref)
    kl, agree = 0.0, 0  # float64 KL(P_fp || P_c2r4), recomputed here from the model's forward over a fresh c2r4 cache
    for w in range(3):
        x = IDS[w * 64 : (w + 1) * 64][None]
        with torch.no_grad():
            lg = mla(x, use_cache=True, **with_cache(make_cache(mla, CacheSpec("c2r4", sink=0, local=0)))).logits
        lq, lr = lg[0].double().log_softmax(-1), ref[w].double()
        kl += float((lr.exp() * (lr - lq)).sum())
        agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
    assert got.kl_to_reference == pytest.approx(kl / (3 * 64), rel=1e-4)
    assert got.top1_agreement == agree / (3 * 64) and got.top1_agreement < 1.0
    assert got.kl_to_reference > 1e-4  # 2-bit content is visibly lossy
    with pytest.raises(ValueError, match="reference_logprobs"):
        perplexity(mla, IDS, context=32, cache=CacheSpec("fp32"), reference=ref)


def test_mla_bf16_cache_close_to_fp32_and_gqa(tiny_mla):
    """The converted model (partial RoPE) through the dual-path BF16 cache: close to its own fp32 run."""
    src, mla = tiny_mla
    p32 = perplexity(mla, IDS, context=64, cache=CacheSpec("fp32")).perplexity
    p16 = perplexity(mla, IDS, context=64, cache=CacheSpec("bf16")).perplexity
    assert p16 == pytest.approx(p32, rel=2e-3)
    pg = perplexity(src, IDS, context=64, cache=CacheSpec("bf16")).perplexity
    assert pg == pytest.approx(p32, rel=0.05)


def test_low_bit_cache_changes_little_then_more(tiny_mla):
    _, mla = tiny_mla
    base = perplexity(mla, IDS, context=64, cache=CacheSpec("bf16", sink=0, local=0)).nll
    d8 = abs(perplexity(mla, IDS, context=64, cache=CacheSpec("c8r8", sink=0, local=0)).nll - base)
    d2 = abs(perplexity(mla, IDS, context=64, cache=CacheSpec("c2r4", sink=0, local=0)).nll - base)
    assert d8 < 0.01 and d2 > d8


def test_gqa_rejects_low_bit(tiny_mla):
    src, _ = tiny_mla
    with pytest.raises(ValueError, match="needs an MLA model"):
        make_cache(src, CacheSpec("c4r4"))


def test_retrieval_runs_and_summarizes(tiny_mla, tokenizer):
    _, mla = tiny_mla
    b = NeedleBuilder(tokenizer, chat=False)
    samples = [b.build("passkey", 300, d, i) for d in (0.2, 0.8) for i in range(2)]
    recs = run_samples(mla, tokenizer, samples, CacheSpec("c4r4"))
    assert len(recs) == 4 and all(isinstance(r["correct"], bool) for r in recs)
    s = summarize(recs)
    assert s["passkey"]["300"]["n"] == 4 and set(s["passkey"]["300"]["by_depth"]) == {"0.2", "0.8"}
    assert all(r["predicted"] is None or len(r["predicted"]) == 5 for r in recs)  # 5-digit passkeys only


def test_retrieval_scores_known_outputs(tiny_mla, tokenizer, monkeypatch):
    """The decoder's output is scripted (right value, a longer number, the value after other words, a wrong
    value), so which records are correct is known by construction, and so is the summary."""
    import quantmla.eval.retrieval as retrieval

    _, mla = tiny_mla
    b = NeedleBuilder(tokenizer, chat=False)
    samples = [b.build("passkey", 300, d, i) for d in (0.2, 0.8) for i in range(2)]
    wrong = str((int(samples[3].value) + 1) % 100000).zfill(5)
    texts = [f" {samples[0].value}. Remember", " 123456789", f"The pass key is {samples[2].value}", f" {wrong}."]
    assert wrong != samples[3].value
    script = iter(texts)
    monkeypatch.setattr(retrieval, "greedy_generate", lambda *a, **k: tokenizer(next(script))["input_ids"])
    recs = retrieval.run_samples(mla, tokenizer, samples, CacheSpec("c4r4"))
    assert [r["correct"] for r in recs] == [True, False, True, False]
    assert [r["predicted"] for r in recs] == [samples[0].value, None, samples[2].value, wrong]
    s = summarize(recs)["passkey"]["300"]
    assert (s["correct"], s["n"], s["accuracy"]) == (2, 4, 0.5)
    assert s["by_depth"] == {"0.2": 0.5, "0.8": 0.5}


def test_evaluate_table_and_write(tiny_mla, tokenizer, tmp_path, monkeypatch):
    _, mla = tiny_mla
    import quantmla.data.corpus as corpus

    monkeypatch.setattr(corpus, "token_stream", lambda tok, src, split, n: IDS[:n])
    cfg = EvalConfig(
        tasks="ppl,passkey",
        formats=("bf16", "c4r4"),
        ppl_tokens=128,
        ppl_context=64,
        lengths=(300,),
        depths=(0.5,),
        n_per_depth=1,
    )
    res = evaluate(mla, tokenizer, cfg, model_name="tiny", progress=False)
    assert set(res["results"]) == {"bf16", "c4r4"} and res["model"]["mla"]
    table = format_table(res)
    assert "PK@300" in table and "tiny" in table and table.count("\n") == 3
    p = tmp_path / "r.json"
    write_result(res, str(p))
    assert json.load(open(p))["config"]["formats"] == ["bf16", "c4r4"]
    with pytest.raises(FileExistsError, match="--force"):
        write_result(res, str(p))
    write_result(res, str(p), force=True)


def test_expand_tasks():
    assert expand_tasks("ppl,niah") == ("ppl", "niah_single_1", "niah_single_2", "niah_single_3", "passkey")
    with pytest.raises(ValueError, match="unknown task"):
        expand_tasks("mmlu")


def test_plot(tiny_mla, tokenizer, tmp_path):
    pytest.importorskip("matplotlib")
    from quantmla.eval.plot import plot_retrieval

    res = {
        "model": {"name": "m"},
        "results": {
            "bf16": {
                "cache": "bf16",
                "retrieval": {
                    "passkey": {
                        "512": {"accuracy": 1.0, "correct": 2, "n": 2},
                        "1024": {"accuracy": 0.5, "correct": 1, "n": 2},
                    }
                },
            }
        },
    }
    p = plot_retrieval(res, str(tmp_path / "a.png"))
    assert open(p, "rb").read(4) == b"\x89PNG"


def test_cli_parses(tmp_path):
    import argparse

    from quantmla.eval.cli import add_eval_args
    from quantmla.models.cli import add_convert_args

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_eval_args(sub)
    add_convert_args(sub)
    a = parser.parse_args(["eval", "--model", "x", "--format", "bf16,c4r4", "--lengths", "512,1024"])
    assert a.lengths == (512, 1024) and a.format == "bf16,c4r4" and a.func.__name__ == "run_eval"
    c = parser.parse_args(["convert", "--variant", "b", "--force"])
    assert c.variant == "b" and c.force and c.func.__name__ == "run_convert"
