"""`quantmla <command> --help`: every option of every subcommand says what it does and what its default is."""

import argparse

import pytest

from quantmla.cli import build_parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"quantmla": parser, **sub.choices}


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _value_default(a: argparse.Action) -> str | None:
    """The default as a user would type it (None: no value to show -- a flag, or no default)."""
    d = a.default
    if d is None or d is argparse.SUPPRESS or isinstance(d, bool):
        return None
    return ",".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)


def test_every_subcommand_is_checked():
    names = set(_subcommands())
    assert {"run", "eval", "calibrate", "calibrate-stream", "merge", "allocate", "analyze", "convert"} <= names


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_option_has_help(command):
    parser = _subcommands()[command]
    missing = [a.option_strings[0] for a in _options(parser) if not (a.help and a.help.strip())]
    assert not missing, f"quantmla {command}: options without help text: {missing}"
    parser.format_help()  # every help string formats (no stray '%')


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_value_default_is_shown(command):
    parser = _subcommands()[command]
    text = "".join(parser.format_help().split())  # wrapping adds whitespace (also inside hyphenated words)
    for a in _options(parser):
        want = _value_default(a)
        if want is None or a.help is argparse.SUPPRESS:
            continue
        shown = " ".join(a.help.replace("%(default)s", want).replace("%%", "%").split())
        assert "default" in shown and want in shown, f"quantmla {command} {a.option_strings[0]}: {a.help!r}"
        assert "".join(shown.split()) in text  # and it is what --help prints
