"""``quantmla eval`` through the entry point on a local model folder: the perplexity it writes equals the one
computed by hand (float64 cross-entropy of the model's own forward on the corpus's test split), the quantized
column is the same computation through a cache of that format, and the table and plot are written."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quantmla.cli import main
from quantmla.data.corpus import token_stream
from quantmla.eval.perplexity import perplexity
from quantmla.eval.runtime import CacheSpec

TEXT = "\n\n".join(f"The sky is blue {i} times. The grass is green. Here we go, there and back." for i in range(300))


@pytest.fixture(scope="module")
def model_dir(tiny_mla, tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("mla-model")
    tiny_mla[1].save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def test_eval_perplexity_equals_the_hand_computation(model_dir, tiny_mla, tokenizer, tmp_path, capsys):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "r.json"
    argv = ["eval", "--model", model_dir, "--format", "fp32,c2r4", "--tasks", "ppl", "--corpus", str(corpus),
            "--ppl-tokens", "256", "--ppl-context", "64", "--sink", "0", "--local", "0", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    ids = token_stream(tokenizer, str(corpus), "test", 256)
    nll, n = 0.0, 0
    for w in range(4):
        x = ids[w * 64 : (w + 1) * 64][None]
        with torch.no_grad():
            lp = tiny_mla[1](x).logits[0].double().log_softmax(-1)
        nll -= float(lp[:-1].gather(-1, x[0, 1:, None]).sum())
        n += 63
    fp32 = res["results"]["fp32"]["ppl"]
    assert fp32["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    c2r4 = res["results"]["c2r4"]["ppl"]["perplexity"]
    # the quantized column: the library's perplexity through a c2r4 cache with the policy given (sink 0, local 0)
    want = perplexity(tiny_mla[1], ids, context=64, cache=CacheSpec("c2r4", sink=0, local=0), progress=False)
    assert c2r4 == pytest.approx(want.perplexity, rel=1e-9)
    assert abs(math.log(c2r4 / fp32["perplexity"])) > 1e-3  # the 2-bit cache really was in the loop
    assert main(argv) != 0  # an existing result is not overwritten without --force
    assert json.loads(out.read_text()) == res
    capsys.readouterr()
