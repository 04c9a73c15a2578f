"""The delta checkpoint: only the tensors QuantMLA changes, and the tools that apply it.

Folding the content and RoPE transforms rewrites, per attention module, ``kv_a_proj_with_mqa`` (weight, bias),
``kv_a_layernorm`` (gain), ``kv_b_proj`` and ``q_proj`` / ``q_b_proj`` (weight, bias) -- about 1% of a
DeepSeek-V3 checkpoint. A delta stores exactly those tensors under their checkpoint names, in the dtype the
calibration ran in, in one safetensors file whose metadata records (JSON strings):

* ``format`` / ``version``: ``quantmla-delta`` / 1;
* ``base_key``: :func:`quantmla.calibrate.checkpoint.base_key` of the checkpoint it was calibrated from;
* ``base_digests``: per replaced tensor, the sha1 of the base bytes it replaces (FP8 scale included), so a delta
  is never merged into a model with the same shapes but other weights (DeepSeek-V3 vs V3-Base);
* ``recipe``: cache format, method, calibration settings, dtype, calibration-token digest; ``report``: the
  per-layer calibration report; ``rope_rounding`` (formats with a RoPE path): the record ``quantmla calibrate``
  writes into ``quantmla.json`` (``{"method": "query-aware", "rotation": {...} or null}``).

Beside the replaced tensors, under :data:`ROUNDING_PREFIX`, a delta carries each layer's query moment and post-RoPE
rotation (where one was chosen), which :func:`merge_checkpoint` writes as the merged folder's :data:`ROUNDING_FILE`.

:func:`apply_delta` overwrites the tensors of a loaded model in place; :func:`merge_checkpoint` writes a
complete new checkpoint shard by shard (one shard in memory at a time): replaced tensors are substituted, the
``weight_scale_inv`` of a replaced FP8 weight is dropped (the folded weight is stored unquantized) and the module
is added to ``quantization_config.modules_to_not_convert``; shards with nothing replaced are hard-linked (copied
across file systems). Every file is written to a temporary path and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from quantmla.artifacts import MANIFEST, staged, write_json
from quantmla.calibrate.checkpoint import (
    INDEX_NAME,
    SCALE_SUFFIX,
    CheckpointError,
    CheckpointReader,
    base_key,
    tensor_digest,
)

DELTA_FORMAT = "quantmla-delta"
DELTA_VERSION = 1
# beside a fused or merged checkpoint: its layers' query moments (a safetensors file whose name does not end in
# ".safetensors": vLLM loads every *.safetensors file of a folder without an index as weights)
ROUNDING_FILE = "quantmla_rope_rounding.st"
ROUNDING_KIND, ROUNDING_VERSION = "quantmla-rope-rounding", 1  # (quantmla.calibrate.query_moments reads it)
ROUNDING_PREFIX = "quantmla_rope_rounding."  # a delta's moments / rotations, by their rounding-file names after it
FOLDED_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "q_proj", "q_b_proj")


def folded_tensor_names(attn: nn.Module, prefix: str) -> list[str]:
    """Checkpoint names (``prefix`` + local name) of every tensor that folding may change in ``attn``."""
    out = []
    for mod_name in FOLDED_MODULES:
        mod = getattr(attn, mod_name, None)
        if mod is None:
            continue
        for p_name, _ in mod.named_parameters(recurse=False):
            out.append(f"{prefix}{mod_name}.{p_name}")
    return out


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]):
    """safetensors ``save_file`` to a temporary sibling, then rename (no half-written file on failure)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def save_tagged(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict, *, kind: str, version: int,
                force: bool = False) -> Path:  # fmt: skip
    """A safetensors file of ``kind`` (metadata ``format``/``version`` + ``meta``, each value stored as JSON),
    written atomically; refuses to overwrite an existing file unless ``force``."""
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force (force=True) to overwrite it")
    full = {"format": kind, "version": version, **meta}
    return atomic_save_safetensors(tensors, path, {k: json.dumps(v) for k, v in full.items()})


def load_tagged(path: str | os.PathLike, *, kind: str, version: int, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, meta)`` of a file written by :func:`save_tagged` with this ``kind``; a file of another kind or
    version raises :class:`CheckpointError` (a ``ValueError``) naming ``what`` was expected."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    with safe_open(path, framework="pt") as f:
        raw = f.metadata() or {}
        if raw.get("format") != json.dumps(kind):
            raise CheckpointError(f"{path} is not a quantmla {what} (metadata format {raw.get('format')!r})")
        meta = {k: json.loads(v) for k, v in raw.items()}
        if meta.get("version") != version:
            raise CheckpointError(f"{path}: {what} version {meta.get('version')!r} unsupported (expected {version})")
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def save_delta(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict, *, force: bool = False,
               rounding: dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    """Write a delta (tensors by checkpoint name + ``meta``). Refuses to overwrite an existing file unless ``force``.
    ``rounding``: the layers' query moments and post-RoPE rotations by their rounding-file names
    (``layers.i.rope.query_moment``, ``layers.i.rope.post_rotation``), stored under :data:`ROUNDING_PREFIX` so that
    :func:`merge_checkpoint` writes them beside the merged weights."""
    bad = [k for k in tensors if k.startswith(ROUNDING_PREFIX)]
    if bad:
        raise ValueError(f"{bad[0]!r}: checkpoint tensor names may not start with {ROUNDING_PREFIX!r}")
    extra = {ROUNDING_PREFIX + k: v for k, v in (rounding or {}).items()}
    return save_tagged(path, {**tensors, **extra}, meta, kind=DELTA_FORMAT, version=DELTA_VERSION, force=force)


def load_delta(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, meta)`` of a delta written by :func:`save_delta` -- the checkpoint tensors it replaces, without
    the query moments and rotations (:func:`load_delta_rounding`); raises on another kind of file."""
    tensors, meta = load_tagged(path, kind=DELTA_FORMAT, version=DELTA_VERSION, what="delta")
    return {k: v for k, v in tensors.items() if not k.startswith(ROUNDING_PREFIX)}, meta


def load_delta_rounding(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The query moments (and post-RoPE rotations) a delta carries, by their rounding-file names ({} for a delta
    without them; a delta from before rotations were carried has moments only)."""
    tensors, _ = load_tagged(path, kind=DELTA_FORMAT, version=DELTA_VERSION, what="delta")
    return {k[len(ROUNDING_PREFIX) :]: v for k, v in tensors.items() if k.startswith(ROUNDING_PREFIX)}


@torch.no_grad()
def apply_delta(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite ``model``'s tensors named in ``tensors`` in place (values cast to the model's dtype and device).
    Raises ``KeyError`` naming a tensor the model lacks and ``ValueError`` on a shape mismatch, before changing
    anything."""
    state = model.state_dict(keep_vars=True)
    for name, t in tensors.items():
        if name not in state:
            raise KeyError(f"the delta has {name!r}, which the model lacks: it was made for another model")
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{name}: delta shape {tuple(t.shape)} != model shape {tuple(state[name].shape)}")
    for name, t in tensors.items():
        state[name].copy_(t.to(dtype=state[name].dtype, device=state[name].device))


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def merge_checkpoint(
    base_dir: str | os.PathLike, delta_path: str | os.PathLike, out_dir: str | os.PathLike, *, force: bool = False
) -> Path:
    """Write ``base_dir`` with the delta applied to ``out_dir`` (a complete checkpoint), one shard at a time.

    Checks first that the delta was made for this base (``base_key`` and the digest of every replaced tensor);
    refuses an existing ``out_dir`` unless ``force``; written through :func:`quantmla.artifacts.staged` (a temporary
    sibling folder, sealed with a completion manifest, renamed into place). The query moments and post-RoPE
    rotations the delta carries become the merged folder's :data:`ROUNDING_FILE` (its query-aware RoPE rounding,
    attached when it is loaded; metadata ``method`` and ``rotation`` as ``quantmla calibrate`` writes them); a
    rounding file of the base is never copied (it was fitted to the weights the delta replaces)."""
    from safetensors.torch import save_file

    base_dir, out = Path(base_dir), Path(out_dir)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    if out.resolve() == base_dir.resolve():
        raise ValueError("--out must differ from --base (the base checkpoint is read while the merge is written)")
    tensors, meta = load_delta(delta_path)
    rounding = load_delta_rounding(delta_path)
    key = base_key(base_dir)
    if meta.get("base_key") != key:
        raise CheckpointError(
            f"the delta was calibrated on {meta.get('base_key')!r}, this base is {key!r}: merge it into that model"
        )
    reader = CheckpointReader(base_dir)
    missing = sorted(set(tensors) - set(reader.weight_map))
    if missing:
        raise CheckpointError(f"the base checkpoint has no {missing[:3]} that the delta replaces")
    digests = meta.get("base_digests") or {}
    drops = {n + SCALE_SUFFIX for n in tensors if reader.is_fp8(n)}
    shards = sorted(set(reader.weight_map.values()))
    key = {"base_key": key, "delta_recipe": meta.get("recipe")}
    with staged(str(out), force=force, key=key) as tmp_name:
        tmp = Path(tmp_name)
        new_map, total = {}, 0
        for shard in shards:
            names = [n for n, s in reader.weight_map.items() if s == shard]
            touched = any(n in tensors or n in drops for n in names)
            part = {}
            for n in names:
                if n in drops:
                    continue
                if n in tensors:
                    src = [reader.raw(s) for s in reader.source_names(n)]
                    if digests.get(n) != tensor_digest(src):
                        raise CheckpointError(f"{n}: the base weights differ from those the delta was calibrated on")
                    part[n] = tensors[n].contiguous()
                elif touched:
                    part[n] = reader.raw(n)
                new_map[n] = shard
            if touched:
                save_file(part, tmp / shard, metadata={"format": "pt"})
                total += sum(t.numel() * t.element_size() for t in part.values())
            else:
                _link_or_copy(base_dir / shard, tmp / shard)
                total += os.path.getsize(base_dir / shard)
            reader.close()
        for f in base_dir.iterdir():
            if f.is_file() and f.name not in shards and f.name not in (INDEX_NAME, "config.json", MANIFEST,
                                                                        ROUNDING_FILE):  # fmt: skip
                shutil.copy2(f, tmp / f.name)
        if rounding:
            rmeta = {"base_key": key["base_key"], "from": "delta", "method": (meta.get("recipe") or {}).get("method"),
                     "rotation": (meta.get("rope_rounding") or {}).get("rotation")}  # fmt: skip
            save_tagged(tmp / ROUNDING_FILE, rounding, rmeta, kind=ROUNDING_KIND, version=ROUNDING_VERSION)
        if (base_dir / INDEX_NAME).exists():
            write_json(tmp_name, INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": new_map})
        cfg = dict(reader.config)
        if drops and cfg.get("quantization_config"):
            q = dict(cfg["quantization_config"])
            keep = sorted({_module_of(n) for n in tensors if n + SCALE_SUFFIX in drops})
            q["modules_to_not_convert"] = sorted(set(q.get("modules_to_not_convert") or []) | set(keep))
            cfg["quantization_config"] = q
        write_json(tmp_name, "config.json", cfg)
        write_json(tmp_name, "quantmla_delta.json", {k: v for k, v in meta.items() if k != "report"})
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def tokens_digest(tokens: torch.Tensor) -> str:
    return hashlib.sha1(tokens.contiguous().cpu().numpy().tobytes()).hexdigest()


__all__ = [
    "DELTA_FORMAT",
    "FOLDED_MODULES",
    "apply_delta",
    "atomic_save_safetensors",
    "folded_tensor_names",
    "load_delta",
    "merge_checkpoint",
    "save_delta",
    "tokens_digest",
]
