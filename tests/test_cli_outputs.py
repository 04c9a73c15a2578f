"""Output paths are checked before the work starts (an impossible ``--out`` costs milliseconds, not the job), an
existing output is replaced only with ``--force``, and ``analyze`` writes its folder whole or not at all."""

from __future__ import annotations

import json
import os

import pytest

import quantmla.main_job as main_job
import quantmla.models.names as names
from quantmla.cli import main


@pytest.fixture
def no_work(monkeypatch):
    """Any model loading means the output check came too late."""

    def refuse(*a, **k):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(names, "resolve_model", refuse)
    monkeypatch.setattr(main_job, "_load", refuse)


def _commands(out: str) -> dict[str, list[str]]:
    ok = f"{os.path.dirname(out)}/ok.json"
    return {
        "run --out": ["run", "--tiny", "--out", f"{out}/r.json"],
        "run --save": ["run", "--tiny", "--save", f"{out}/ckpt"],
        "eval --out": ["eval", "--model", "smollm2-mla", "--out", f"{out}/e.json"],
        "eval --plot": ["eval", "--model", "smollm2-mla", "--out", ok, "--plot", f"{out}/e.png"],
        "calibrate --out": ["calibrate", "--model", "smollm2-mla", "--out", f"{out}/c"],
        "analyze --out": ["analyze", "--model", "smollm2-mla", "--out", f"{out}/a"],
        "convert --out": ["convert", "--out", f"{out}/m"],
    }


@pytest.mark.parametrize("which", list(_commands("X")))
def test_out_under_a_file_is_refused_before_the_work(tmp_path, capsys, no_work, which):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    argv = _commands(str(blocker))[which]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{blocker} is a file, not a folder" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nobody can create files in: chmod 555, or for root (who ignores permission bits) /sys."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        yield str(ro)
        ro.chmod(0o755)
        return
    try:
        os.close(os.open("/sys/.quantmla-probe", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        yield "/sys"
    else:  # pragma: no cover
        os.unlink("/sys/.quantmla-probe")
        pytest.skip("no read-only folder for root here")


@pytest.mark.parametrize("which", list(_commands("X")))
def test_out_in_a_read_only_folder_is_refused_before_the_work(read_only_dir, tmp_path, capsys, no_work, which):
    argv = _commands(read_only_dir)[which]
    if which == "eval --plot":
        argv[argv.index("--out") + 1] = str(tmp_path / "ok.json")
    assert main(argv) == 2
    assert f"cannot write in {read_only_dir}" in capsys.readouterr().err


def test_existing_outputs_need_force(tmp_path, capsys, no_work):
    (tmp_path / "r.json").write_text("{}")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "error_model.json").write_text("{}")
    for argv in (["run", "--tiny", "--out", str(tmp_path / "r.json")],
                 ["analyze", "--model", "smollm2-mla", "--out", str(tmp_path / "a")]):  # fmt: skip
        assert main(argv) == 2
        assert "exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "r.json").read_text() == "{}" and (tmp_path / "a" / "error_model.json").read_text() == "{}"


def test_calibrate_config_with_an_unknown_key(tmp_path, capsys, no_work):
    cfg = tmp_path / "calib.json"
    cfg.write_text(json.dumps({"steps_content": 3, "step_rope": 3}))  # misspelt
    assert main(["calibrate", "--model", "smollm2-mla", "--out", str(tmp_path / "c"), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown field 'step_rope'" in err and "valid fields: method, seq_len" in err and "steps_rope" in err


def test_calibrate_config_accepts_known_keys(tmp_path):
    from quantmla.calibrate.cli import config_from_args
    from quantmla.cli import build_parser

    cfg = tmp_path / "calib.json"
    cfg.write_text(json.dumps({"steps_content": 3, "steps_rope": 5, "seq_len": 256}))
    args = build_parser().parse_args(["calibrate", "--model", "m", "--out", "o", "--config", str(cfg), "--seed", "7"])
    c = config_from_args(args)
    assert (c.steps_content, c.steps_rope, c.seq_len, c.seed) == (3, 5, 256, 7)
    assert c.rope_weighting == "attention"  # ours unless asked; the paper's objective by name
    args = build_parser().parse_args(["calibrate", "--model", "m", "--out", "o", "--rope-weighting", "uniform"])
    assert config_from_args(args).rope_weighting == "uniform"
    assert c.matmul_precision == "fp32"  # full fp32 unless asked
    args = build_parser().parse_args(["calibrate-stream", "--model", "m", "--out", "o", "--matmul-precision", "tf32"])
    assert config_from_args(args).matmul_precision == "tf32"


def test_calibrate_rejects_an_unknown_rope_weighting(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--model", "m", "--out", str(tmp_path / "c"), "--rope-weighting", "softmax"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--rope-weighting" in err and "attention" in err and not (tmp_path / "c").exists()


def _tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from quantmla.mla.tiny import tiny_model

    words = ["<unk>", "<s>", "</s>"] + "the of and to a in that is my you".split()
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tiny_model("deepseek_v3"), tok


def test_analyze_replaces_its_folder_only_with_force_and_whole(tmp_path, monkeypatch, capsys):
    model, tok = _tiny_model_and_tokenizer()
    monkeypatch.setattr(names, "resolve_model", lambda name, dtype: (model, tok, "tiny"))
    out = tmp_path / "analysis"
    argv = ["analyze", "--model", "smollm2-mla", "--out", str(out), "--seqs", "2", "--seq-len", "192",
            "--batch-size", "2", "--query-tokens", "16", "--levels", "1e-2", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    first = json.loads((out / "error_model.json").read_text())
    assert (out / "atlas_nmse0.01.png").stat().st_size > 0
    (out / "mine.txt").write_text("a file of the user's")
    assert main(argv) == 2  # refused, untouched
    assert (out / "mine.txt").exists()

    import quantmla.analysis.error_model as em

    def fail(*a, **k):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(em, "plot_atlas", fail)
    assert main([*argv, "--force"]) == 1  # a failure while writing leaves the old folder and no temp folder
    assert (out / "mine.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["analysis"]
    monkeypatch.undo()
    monkeypatch.setattr(names, "resolve_model", lambda name, dtype: (model, tok, "tiny"))
    assert main([*argv, "--force"]) == 0
    assert not (out / "mine.txt").exists() and json.loads((out / "error_model.json").read_text()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis"]
    capsys.readouterr()
