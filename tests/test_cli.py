"""The command line: `quantmla info` numbers and errors, `quantmla generate` on a local model directory."""

import json
import re

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
    assert set(rows) == {"bf16", "c8r8", "c4r8", "c4r4", "c2r4", "c4r4t", "c2r4t"}
    pages = 131072 // 64
    bf16 = 27 * 131072 * 1152 + pages * 4 + 4
    c4r4 = 27 * (131072 * 308 + 132 * 1152) + pages * 4 + 4
    c4r4t = 27 * (131072 * 296 + 132 * 1152) + pages * 4 + 4  # one content scale + offset per token: 12 B less
    assert rows["bf16"]["total_bytes"] == bf16
    assert rows["c4r4"]["total_bytes"] == c4r4
    assert rows["c4r4t"]["total_bytes"] == c4r4t
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
def test_info_bad_input(argv, match, capsys):
    assert main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_info_refuses_non_mla_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert main(["info", "--model-config", str(cfg)]) == 2
    assert "not an MLA model" in capsys.readouterr().err


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
    assert "tok/s" in out and "B on a BF16 model" in out and "smaller than BF16" not in out


def test_generate_bad_model_dir(capsys):
    assert main(["generate", "--model", "/nonexistent", "--prompt", "hi"]) == 2
    assert "neither a folder nor a built-in name" in capsys.readouterr().err


def test_generate_takes_the_model_names_eval_takes(tmp_path, monkeypatch, capsys):
    import quantmla.models.names as names

    path, model, tok = _tiny_dir(tmp_path)
    seen = []
    monkeypatch.setattr(names, "resolve_model", lambda name, dtype: (seen.append(name), model, tok, name)[1:])
    code, out = _run(capsys, "generate", "--model", "smollm2-mla", "--prompt", "w3 w4 w5", "--max-new-tokens", "2")
    assert code == 0 and seen == ["smollm2-mla"]


def test_generate_bad_prompts_and_folders(tmp_path, capsys):
    path, model, tok = _tiny_dir(tmp_path)
    assert main(["generate", "--model", path, "--prompt", "  "]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    limit = model.config.max_position_embeddings
    long_prompt = " ".join(f"w{3 + i % 100}" for i in range(limit))
    assert main(["generate", "--model", path, "--prompt", long_prompt, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert f"the prompt is {limit} tokens + --max-new-tokens 4 > the model's context of {limit} tokens" in err
    weightless = tmp_path / "no-weights"
    weightless.mkdir()
    (weightless / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    assert main(["generate", "--model", str(weightless), "--prompt", "w3"]) == 2
    assert "has a config.json but no weights" in capsys.readouterr().err
    assert main(["generate", "--model", path, "--prompt", "w3", "--graph"]) == 2  # the captured step is CUDA's
    assert "--graph captures the decode step in a CUDA graph: it needs --device cuda" in capsys.readouterr().err


def test_generate_byte_report_for_bf16_and_c4r4(tmp_path, capsys):
    from quantmla.quant.formats import cache_bytes

    path, model, tok = _tiny_dir(tmp_path)
    prompt = " ".join(f"w{i}" for i in range(3, 40))
    for fmt in ("bf16", "c4r4"):
        code, out = _run(capsys, "generate", "--model", path, "--format", fmt, "--prompt", prompt,
                         "--max-new-tokens", "6")  # fmt: skip
        line = out.strip().splitlines()[-1]
        n = int(re.match(r"cache: (\d+) tokens", line).group(1))
        assert len(tok(prompt).input_ids) < n <= len(tok(prompt).input_ids) + 6
        spec = dict(kv_lora_rank=model.config.kv_lora_rank, rope_dim=model.config.qk_rope_head_dim,
                    num_layers=model.config.num_hidden_layers, context=n, batch=1)  # fmt: skip
        assert f"{cache_bytes(fmt, **spec).total:,} B on a BF16 model" in line and "allocated" in line
        assert ("less than BF16" in line) == (fmt != "bf16")  # no "1.00x smaller" for BF16 itself


def test_generate_log_has_no_progress_bars(tmp_path):
    """stderr a pipe (a log): transformers' loading bars stay off; the output is the text and the report."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import quantmla

    path, model, tok = _tiny_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(quantmla.__file__).resolve().parents[1])}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    r = subprocess.run([sys.executable, "-m", "quantmla.cli", "generate", "--model", path, "--prompt", "w3 w4",
                        "--max-new-tokens", "2"], capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 0 and r.stderr == "" and "tok/s" in r.stdout
