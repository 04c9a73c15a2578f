"""Every CLI error is one line on stderr naming what was wrong, exit code 2 for bad arguments and 1 for a failure
while the job runs; ``--debug`` / ``QUANTMLA_DEBUG=1`` show the traceback; ``--help`` imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import quantmla
from quantmla import info as info_mod
from quantmla.cli import build_parser, main

SRC = str(Path(quantmla.__file__).resolve().parents[1])


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run([sys.executable, "-m", "quantmla.cli", *argv], capture_output=True, text=True, env=e)


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line
    return err


def test_help_and_argument_errors_import_no_torch():
    code = (
        "import sys\n"
        "from quantmla.cli import main\n"
        "cmds = ['run', 'info', 'generate', 'convert', 'eval', 'calibrate', 'analyze']\n"
        "for argv in [['--help']] + [[c, '--help'] for c in cmds] + [['eval', '--ppl-context', 'x']]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": SRC})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_argparse_error_is_one_line_with_exit_code_2():
    r = _cli("eval", "--model", "smollm2-mla", "--ppl-context", "x")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "quantmla eval: error: argument --ppl-context: invalid int value: 'x' (see `quantmla eval --help`)"
    ]


def test_usage_error_through_the_entry_point():
    r = _cli("info", "--preset", "llama-3")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "quantmla info: error: unknown --preset 'llama-3'; choose one of deepseek-v2-lite, deepseek-v2, deepseek-v3, "
        "kimi-k2, glm-4.7-flash"
    ]


def _boom(args):
    raise RuntimeError("disk on fire\nsecond line of detail")


def test_runtime_failure_is_one_line_exit_1_and_debug_shows_it(monkeypatch, capsys):
    monkeypatch.setattr(info_mod, "cmd_info", _boom)  # the parser binds the command when it is built
    assert main(["info"]) == 1
    err = _err(capsys)
    assert err.startswith("quantmla info: error: RuntimeError: disk on fire") and "--debug" in err
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["info", "--debug"])
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["--debug", "info"])
    monkeypatch.setenv("QUANTMLA_DEBUG", "1")
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["info"])


def test_a_command_raising_systemexit_text_gets_the_same_one_line_usage_error(monkeypatch, capsys):
    def legacy(args):
        raise SystemExit("error: --x 3 is too big; use at most 2")

    monkeypatch.setattr(info_mod, "cmd_info", legacy)
    assert main(["info"]) == 2
    assert _err(capsys) == "quantmla info: error: --x 3 is too big; use at most 2\n"


def test_every_option_has_help():
    from quantmla.cli import COMMANDS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "run" in a.choices)
    core = {"run", "info", "generate", "convert", "eval", "calibrate", "analyze"}
    assert len(COMMANDS) == len(core) and core <= set(sub.choices)
    missing = [
        f"{name} {'/'.join(a.option_strings)}"
        for name, p in sub.choices.items()
        if name in core
        for a in p._actions
        if a.option_strings and not a.help
    ]
    assert missing == []


# -- quantmla info: bad model configs (issue 13 item 6) ----------------------------------------------------------
def _cfg(tmp_path, body: bytes | str, name: str = "config.json") -> str:
    p = tmp_path / name
    p.write_bytes(body if isinstance(body, bytes) else body.encode())
    return str(p)


MLA = {"model_type": "deepseek_v2", "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


@pytest.mark.parametrize(
    "body,match",
    [
        (json.dumps({**MLA, "kv_lora_rank": 0}), "'kv_lora_rank' must be a positive integer, got 0"),
        (json.dumps({**MLA, "kv_lora_rank": -512}), "'kv_lora_rank' must be a positive integer, got -512"),
        (json.dumps({k: v for k, v in MLA.items() if k != "num_hidden_layers"}), "lacks the field 'num_hidden_layers'"),
        (json.dumps([MLA]), "holds a JSON list, not an object"),
        (b"\xff\xfe{\x00", "is not UTF-8 text"),
        ("{model_type: deepseek_v2", "is not valid JSON"),
        (json.dumps({**MLA, "kv_lora_rank": 100}), "group_size=128 does not divide the path width 100"),
    ],
)
def test_info_bad_config(tmp_path, capsys, body, match):
    assert main(["info", "--model-config", _cfg(tmp_path, body)]) == 2
    assert match in _err(capsys)


def test_info_config_folder(tmp_path, capsys):
    assert main(["info", "--model-config", str(tmp_path)]) == 2
    assert "is a folder without config.json" in _err(capsys)
    _cfg(tmp_path, json.dumps(MLA))
    assert main(["info", "--model-config", str(tmp_path), "--json"]) == 0  # the folder of a config.json works
    assert json.loads(capsys.readouterr().out)["cache_layers"] == 2


def test_info_huge_context(capsys):
    assert main(["info", "--context", str(10**300)]) == 2
    assert "--context x --batch" in _err(capsys)


# -- quantmla eval: every argument checked before the model loads (issue 13 item 8) -------------------------------
@pytest.fixture
def no_loading(monkeypatch):
    """Fail loudly if a command gets as far as loading a model."""
    import quantmla.models.names as names

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(names, "resolve_model", refuse)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--format", "c3r4"], "unknown cache format 'c3r4'"),
        (["--format", ","], "names no format"),
        (["--tasks", "ppl,nope"], "unknown task 'nope'"),
        (["--tasks", ","], "names no task"),
        (["--ppl-context", "0"], "--ppl-context 0: give a positive number"),
        (["--ppl-tokens", "100", "--ppl-context", "200"], "ppl_tokens 100 < ppl_context 200"),
        (["--depths", "1.5"], "depth 1.5 outside"),
    ],
)
def test_eval_bad_arguments(tmp_path, capsys, no_loading, extra, match):
    argv = ["eval", "--model", "smollm2-mla", "--out", str(tmp_path / "e.json"), *extra]
    assert main(argv) == 2
    assert match in _err(capsys)


def test_eval_unknown_model(tmp_path, capsys, no_loading):
    assert main(["eval", "--model", "smollm3-mla", "--out", str(tmp_path / "e.json")]) == 2
    err = _err(capsys)
    assert "'smollm3-mla' is neither a folder nor a built-in name" in err and "smollm2-mla" in err
