"""The main job's report: per-window scoring adds up to the all-windows measures, the perplexity difference carries
its paired standard error, and the headline leads with KL and top-1."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from quantmla.eval.perplexity import perplexity, reference_logprobs
from quantmla.eval.runtime import CacheSpec
from quantmla.mla.tiny import tiny_model
from quantmla.quant.formats import CachePolicy
from quantmla.run_report import accuracy_headline, accuracy_summary, paired_log_ppl_diff, score


def test_score_per_window_equals_all_windows_at_once():
    model = tiny_model("deepseek_v3", first_k_dense_replace=99)
    ids = torch.randint(0, model.config.vocab_size, (3 * 160,), generator=torch.Generator().manual_seed(0))
    ref = reference_logprobs(model, ids, context=160)
    policy = CachePolicy(sink=4, local=16)
    r = score(model, ids, ref, "c4r4", 160, policy)
    whole = perplexity(model, ids, context=160, cache=CacheSpec("c4r4", 4, 16), reference=ref)
    assert len(r["window_nll"]) == 3
    assert r["perplexity"] == pytest.approx(whole.perplexity, rel=1e-6)
    assert r["kl_to_full_precision"] == pytest.approx(whole.kl_to_reference, rel=1e-6)
    assert r["top1_agreement"] == pytest.approx(whole.top1_agreement, abs=1e-12)


def _row(ppl_windows, kl, top1):
    nll = [math.log(p) for p in ppl_windows]
    return {"window_nll": nll, "perplexity": math.exp(statistics.fmean(nll)), "kl_to_full_precision": kl,
            "top1_agreement": top1}  # fmt: skip


def test_paired_difference_and_its_standard_error():
    a, b = _row([30.0, 20.0, 25.0, 28.0], 0, 0), _row([30.3, 20.1, 25.2, 28.1], 0, 0)
    d = [math.log(x) - math.log(y) for x, y in zip([30.0, 20.0, 25.0, 28.0], [30.3, 20.1, 25.2, 28.1])]
    mean, se = paired_log_ppl_diff(a, b)
    assert mean == pytest.approx(statistics.fmean(d)) and se == pytest.approx(statistics.stdev(d) / 2)
    assert math.isnan(paired_log_ppl_diff(_row([3.0], 0, 0), _row([4.0], 0, 0))[1])


def test_headline_leads_with_kl_and_top1_and_calls_a_noisy_sign_noisy():
    bf16 = _row([29.0, 29.5, 29.2, 29.3], 0.0, 1.0)
    rtn = _row([29.1, 29.6, 29.3, 29.35], 5.8e-3, 0.960)
    qm = _row([29.12, 29.55, 29.32, 29.34], 3.5e-3, 0.966)  # mixed signs against RTN: no verdict
    s = accuracy_summary(bf16, rtn, qm)
    assert s["kl_removed_vs_rtn"] == pytest.approx(1 - 3.5 / 5.8)
    first, second = accuracy_headline(s, "C4R4", bf16, rtn, qm, 512)
    assert "KL divergence" in first and "0.966" in first and "(RTN 0.960)" in first and "erplexity" not in first
    assert second.strip().startswith("Perplexity") and "+-" in second and "too close to call" in second
    clear = _row([29.0, 29.4, 29.1, 29.2], 3.5e-3, 0.966)  # lower than RTN in every window
    s2 = accuracy_summary(bf16, rtn, clear)
    assert "QuantMLA lower" in accuracy_headline(s2, "C4R4", bf16, rtn, clear, 512)[1]
