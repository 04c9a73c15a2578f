"""``quantmla analyze`` through the entry point on a local model folder: what it writes is the error model of that
model on that corpus's calibration split with the given sizes and levels (the library call with the same inputs,
itself checked against Monte-Carlo in test_error_model / test_predictor), plus one atlas per level."""

from __future__ import annotations

import json
import random

from quantmla.analysis.error_model import analyze_model
from quantmla.cli import main
from quantmla.data.corpus import token_stream
from quantmla.mla.tiny import tiny_model


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + "the of and to a in that is my you sky blue grass green".split()
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_analyze_writes_the_error_model_of_that_model_and_text(tmp_path, capsys):
    model, tok = tiny_model("deepseek_v3"), _tokenizer()
    mdir = tmp_path / "model"
    model.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    corpus = tmp_path / "text.txt"
    rng = random.Random(0)  # varied text: every split of it gives other tokens
    vocab = "the of and to a in that is my you sky blue grass green".split()
    corpus.write_text("\n\n".join(" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(400)))
    out = tmp_path / "analysis"
    argv = ["analyze", "--model", str(mdir), "--out", str(out), "--corpus", str(corpus), "--seqs", "2",
            "--seq-len", "64", "--batch-size", "2", "--query-tokens", "16", "--levels", "1e-2,1e-3",
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    got = json.loads((out / "error_model.json").read_text())
    tokens = token_stream(tok, str(corpus), "calibration", 128).view(2, 64)
    want = analyze_model(model, tokens, "c4r4", [1e-2, 1e-3], 2, 16, (), 4, "cpu")
    assert got["model_level"] == json.loads(json.dumps(want.model_level()))
    rows = [(r["layer"], r["cache_nmse"], r["content_response"], r["rope_response"]) for r in got["layers"]]
    assert rows == [(r.layer, r.cache_nmse, r.content_response, r.rope_response) for r in want.layers]
    assert all(r[2] > 0 and r[3] > 0 for r in rows)
    assert sorted(p.name for p in out.iterdir()) == ["atlas_nmse0.001.png", "atlas_nmse0.01.png", "error_model.json",
                                                     "quantmla_complete.json"]  # fmt: skip
    other = tmp_path / "other.txt"  # another text gives another error model (the corpus is really read)
    other.write_text("\n\n".join(f"you my that a of to the {i % 5} blue sky" for i in range(400)))
    assert main([*argv[:4], str(tmp_path / "a2"), "--corpus", str(other), *argv[7:]]) == 0
    assert json.loads((tmp_path / "a2" / "error_model.json").read_text())["layers"] != got["layers"]
    capsys.readouterr()
