"""``quantmla <command>``: the command-line interface (wiring and error reporting; the commands live elsewhere).

Commands: ``run`` (the main job, :mod:`quantmla.main_job`), ``info`` (:mod:`quantmla.info`), ``generate``
(:mod:`quantmla.generate`), ``convert``, ``eval``, ``calibrate``, ``analyze`` (the ``cli`` module of their package).

Every error is one line on stderr naming what was wrong and how to fix it; exit code 2 for bad arguments, 1 for a
failure while the job runs, 130 on Ctrl-C. ``--debug`` (or ``QUANTMLA_DEBUG=1``) shows the traceback instead.
Parsing imports no torch or transformers, so ``--help`` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import os
import sys

from quantmla.cli_support import UsageError

DEBUG_ENV = "QUANTMLA_DEBUG"
# (module, function adding the subcommand); the command modules import torch only inside their commands
COMMANDS = (
    ("quantmla.main_job", "add_run_args"),
    ("quantmla.info", "add_info_args"),
    ("quantmla.generate", "add_generate_args"),
    ("quantmla.models.cli", "add_convert_args"),
    ("quantmla.eval.cli", "add_eval_args"),
    ("quantmla.calibrate.cli", "add_calibrate_args"),
    ("quantmla.analysis.cli", "add_analyze_args"),
)
OPTIONAL_COMMANDS = (  # registered when their modules are present
    ("quantmla.calibrate.stream_cli", "add_stream_args"),  # calibrate-stream, merge
    ("quantmla.analysis.allocate_cli", "add_allocate_args"),  # allocate
)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (plus where to read more) and exit with code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    p = _Parser(prog="quantmla", description="Low-bit dual-path KV cache for MLA models (QuantMLA).")
    p.add_argument("--debug", action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    sub = p.add_subparsers(dest="command", metavar="<command>")
    for module, adder in COMMANDS:
        getattr(importlib.import_module(module), adder)(sub)
    for module, adder in OPTIONAL_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # the module is there but something it needs is not: say so
                raise
            continue
        getattr(mod, adder)(sub)
    for sp in sub.choices.values():  # `quantmla eval ... --debug` works too
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        _show_defaults(sp)
    return p


def default_text(default) -> str | None:
    """How an option's default reads in its help (None: nothing to show -- no value, or a flag)."""
    if default is None or isinstance(default, bool) or default is argparse.SUPPRESS:
        return None
    if isinstance(default, (tuple, list)):
        return ",".join(str(x) for x in default)
    return str(default)


def default_shown(help_text: str, text: str) -> bool:
    """Whether ``help_text`` already states the default ``text`` (next to the word "default")."""
    return "%(default)" in help_text or ("default" in help_text and text in help_text)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default X)" to every option's help that does not already name its default value."""
    for a in parser._actions:
        text = default_text(a.default)
        if not a.option_strings or text is None or not a.help or a.help is argparse.SUPPRESS:
            continue
        if not default_shown(a.help, text):
            a.help = f"{a.help} (default {text.replace('%', '%%')})"


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if isinstance(e, KeyError) and text.startswith(("'", '"')):
        text = f"missing key {text}"
    if isinstance(e, (UsageError, OSError, ValueError, LookupError)) and text:
        return text + (" ..." if len(lines) > 1 else "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def main(argv: list[str] | None = None) -> int:
    from quantmla.progress import stderr_is_terminal

    if not stderr_is_terminal():  # a log: no tqdm bars from transformers / huggingface_hub (loading, GGUF)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if args.command is None:
        parser.print_help()
        return 0
    prog = f"quantmla {args.command}"
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # `raise SystemExit("error: ...")`: a command's own argument check
        if debug or not isinstance(e.code, str):
            raise
        msg = e.code[len("error: ") :] if e.code.startswith("error: ") else e.code
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every failure becomes one line unless --debug
        if debug:
            raise
        print(f"{prog}: error: {_one_line(e)} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
