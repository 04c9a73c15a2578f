"""The benchmarks' one way to name and write result files: ``<out>/<name>_<tag>.{json,md}``, refused when present
unless ``--force``, each written to a temporary file and renamed (an interrupted run leaves no half-written file).
Used by ``decode_breakdown.py``, ``bench_graph_decode.py``, ``step_profile.py``, ``eval_speed.py`` and the allocation
benchmarks."""

from __future__ import annotations

import os
import re


def gpu_models(text: str) -> list[str]:
    """The GPU model names (a100, h100, h200, b200, ...) in a tag or a device name, lower case."""
    return re.findall(r"(?<![a-z0-9])([ahb]\d{3})(?![0-9])", text.lower())


def gpu_tag() -> str:
    """The default tag of a GPU result: the model of the GPU this runs on (``h100``, ``h200``; ``gpu`` for a model
    without such a name), ``cpu`` without CUDA -- so a file's name says the card that made it."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return next(iter(gpu_models(torch.cuda.get_device_name())), "gpu")


def add_output_args(ap, tag: str | None = None) -> None:
    """``--out``, ``--tag`` and ``--force`` on an argument parser (``--tag`` left out: None, which the GPU
    benchmarks read as ``gpu_tag()``)."""
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=tag)
    ap.add_argument("--force", action="store_true")


def parse_gpu_args(ap, name: str, what: str):
    """Add the output arguments, parse, require a CUDA GPU (``what`` says why) -> (args, result stem)."""
    import torch

    add_output_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"{what}: it needs a CUDA GPU")
    args.tag = args.tag or gpu_tag()
    return args, result_stem(args.out, name, args.tag, args.force)


def result_stem(out: str, name: str, tag: str, force: bool) -> str:
    """``<out>/<name>_<tag>``; a clear error when its .json or .md exists and ``force`` is not set."""
    stem = os.path.join(out, f"{name}_{tag}")
    if not force and any(os.path.exists(stem + s) for s in (".json", ".md")):
        raise SystemExit(f"{stem}.json/.md exist; pass --force to overwrite")
    return stem


def write_results(stem: str, files: dict[str, str]) -> None:
    """Write ``stem + suffix`` for each ``suffix: text`` through a temporary file and a rename."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    for suffix, text in files.items():
        tmp = stem + suffix + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, stem + suffix)
