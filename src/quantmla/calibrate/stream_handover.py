"""A streamed calibration's progress as one small file, to continue it on another machine.

A work directory of :func:`quantmla.calibrate.stream.calibrate_streamed` holds, per finished block, the folded
tensors and the learned transforms, plus the hidden states entering the next block (``bank.pt``, the largest
file). Only the transforms are needed to go on: :func:`pack_progress` writes them with ``progress.json`` and each
block's metadata (base-tensor digests, layer reports) into one safetensors file (a few hundred KB per block for the
embedded model); :func:`unpack_progress` turns it back into a work directory of *thin* parts without a bank.
``calibrate_streamed(..., resume=True)`` on that directory recomputes the bank through the finished blocks, folds
each thin part's transforms into its base weights again, and continues with the next block.

Used by ``benchmarks/full_budget.py`` to split a calibration across device calls on machines that do not outlive
the call (each call's output comes back, the next call carries it in).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

PROGRESS_FORMAT = "quantmla-stream-progress"
PROGRESS_VERSION = 1


def pack_progress(work: str | os.PathLike, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the finished blocks' transforms and the progress of ``work`` to ``path`` (temp file + rename)."""
    from safetensors import safe_open

    from quantmla.calibrate.delta import save_tagged
    from quantmla.calibrate.stream import PROGRESS, TF_PREFIX, part_path

    work = Path(work)
    try:
        with open(work / PROGRESS) as f:
            progress = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"{work}: no readable {PROGRESS} ({e}); not a calibrate-stream work directory") from None
    tensors: dict[str, torch.Tensor] = {}
    parts = []
    for b in range(int(progress["blocks_done"])):
        with safe_open(part_path(work, b), framework="pt") as f:
            parts.append(f.metadata() or {})
            tensors.update({f"{b}.{k}": f.get_tensor(k) for k in f.keys() if k.startswith(TF_PREFIX)})
    return save_tagged(path, tensors, {"progress": progress, "parts": parts}, kind=PROGRESS_FORMAT,
                       version=PROGRESS_VERSION, force=force)  # fmt: skip


def progress_of(path: str | os.PathLike) -> dict:
    """The ``progress.json`` stored in a packed file (``blocks_done``, ``recipe_sha1``, ``base_key``, ...)."""
    from quantmla.calibrate.delta import load_tagged

    return load_tagged(path, kind=PROGRESS_FORMAT, version=PROGRESS_VERSION, what="packed calibration progress")[1][
        "progress"
    ]


def unpack_progress(path: str | os.PathLike, work: str | os.PathLike, *, force: bool = False) -> int:
    """Rebuild a work directory (thin parts, ``progress.json``, no bank) from a packed file; returns the number of
    finished blocks. Refuses to replace an existing ``work`` unless ``force``; the directory appears whole or not at
    all (built beside it, then renamed)."""
    from quantmla.calibrate.delta import atomic_save_safetensors, load_tagged
    from quantmla.calibrate.stream import PROGRESS, THIN, _write_json, part_path

    tensors, meta = load_tagged(path, kind=PROGRESS_FORMAT, version=PROGRESS_VERSION,
                                what="packed calibration progress")  # fmt: skip
    work = Path(work)
    if work.exists() and not force:
        raise FileExistsError(f"{work} exists; pass force=True to replace it with the packed progress of {path}")
    tmp = work.with_name(f".{work.name}.unpack")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for b, part_meta in enumerate(meta["parts"]):
        mine = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(b)}
        atomic_save_safetensors(mine, part_path(tmp, b), {**part_meta, THIN: "1"})
    _write_json(tmp / PROGRESS, meta["progress"])
    if work.exists():
        shutil.rmtree(work)
    os.replace(tmp, work)
    return int(meta["progress"]["blocks_done"])


__all__ = ["pack_progress", "progress_of", "unpack_progress"]
