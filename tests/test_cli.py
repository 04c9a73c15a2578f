"""The command line: `quantmla info` numbers and errors, `quantmla generate` on a local model directory."""

import json

import pytest
import torch

from quantmla.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_info_json_matches_hand_computation(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "deepseek_v2", "num_hidden_layers": 27, "kv_lora_rank": 512,
                               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}))
    code, out = _run(capsys, "info", "--model-config", str(cfg), "--format", "c4r4", "--context", "131072", "--json")
    assert code == 0
    rows = {r["format"]: r for r in json.loads(out)["formats"]}
    assert set(rows) == {"bf16", "c8r8", "c4r8", "c4r4", "c2r4"}
    pages = 131072 // 64
    bf16 = 27 * 131072 * 1152 + pages * 4 + 4
    c4r4 = 27 * (131072 * 308 + 132 * 1152) + pages * 4 + 4
    assert rows["bf16"]["total_bytes"] == bf16
    assert rows["c4r4"]["total_bytes"] == c4r4
    assert rows["c4r4"]["compression_vs_bf16"] == pytest.approx(bf16 / c4r4)
    assert rows["c4r4"]["compression_vs_bf16"] >= 3.7 and rows["c2r4"]["compression_vs_bf16"] >= 6.0


def test_info_table_marks_the_chosen_format(capsys):
    code, out = _run(capsys, "info", "--preset", "deepseek-v3", "--format", "c2r4", "--context", "4096")
    assert code == 0
    line = [ln for ln in out.splitlines() if ln.startswith("c2r4")][0]
    assert line.endswith("<") and "61 cache layers" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["info", "--model-config", "/nonexistent/config.json"], "does not exist"),
        (["info", "--preset", "llama-3"], "unknown --preset"),
        (["info", "--format", "c3r4"], "unknown cache format"),
        (["info", "--sink", "-1"], "CachePolicy.sink"),
        (["info", "--context", "0"], "positive"),
    ],
)
def test_info_bad_input(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)


def test_info_refuses_non_mla_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(SystemExit, match="not an MLA model"):
        main(["info", "--model-config", str(cfg)])


def _tiny_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from quantmla.mla.tiny import tiny_model

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return str(tmp_path / "m"), model, tok


def test_generate_on_a_local_model_dir(tmp_path, capsys):
    path, model, tok = _tiny_dir(tmp_path)
    prompt = " ".join(f"w{i}" for i in range(3, 40))
    code, out = _run(capsys, "generate", "--model", path, "--format", "bf16", "--prompt", prompt,
                     "--max-new-tokens", "6")
    assert code == 0
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    want = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.splitlines()[0] == want  # BF16 cache: the very tokens of transformers' own cache
    assert "tok/s" in out and "B physical" in out


def test_generate_bad_model_dir():
    with pytest.raises(SystemExit, match="not a directory"):
        main(["generate", "--model", "/nonexistent", "--prompt", "hi"])
