"""Streamed calibration: QuantMLA on a checkpoint far larger than memory, one decoder block at a time.

:func:`calibrate_streamed` never holds more than one decoder block's weights. The model is built on the
``meta`` device; only the embedding is loaded to compute the hidden states entering block 0 (then freed). For
each block in turn it reads that block's tensors from the shards (memory-mapped, :mod:`.checkpoint`;
FP8 block-scaled weights dequantized on load, directly on the calibration device), runs the calibration
sequences through it, calibrates its attention module(s) exactly as :func:`quantmla.calibrate.calibrate_model`
does (same captured inputs, same seeds, same code), folds the transforms, keeps only the tensors folding
changed, and frees the block. The result is a delta checkpoint (:mod:`.delta`), equal bit for bit to what the
in-memory calibration changes (tested), which ``quantmla merge`` applies.

Memory: one block (in ``dtype``, on the device) plus the activation banks on the CPU -- the hidden states
entering the block, those leaving it and the attention inputs, each [N, T, D] in ``dtype``.

Resumable: progress lives in a work directory (``<out>.work`` by default): one delta part per finished block,
the hidden states entering the next block (``bank.pt``) and ``progress.json``, each written to a temporary file
and renamed, so an interrupt (or a crash) loses at most the block in flight. ``resume=True`` continues after the
last finished block if the recipe and the base checkpoint are the same (else it refuses); the finished delta is
identical to an uninterrupted run's.

The bank is a cache: when it is missing, resuming recomputes it through the finished blocks with their original
weights (exactly as the first pass did; bit for bit on the same device). A *thin* part holds only a block's
transforms (:mod:`.stream_handover` packs a work directory that small, to move it to another machine); resuming
folds them into the block's base weights again, so the delta equals an uninterrupted run's to the fp32 rounding of
the transforms, and the transforms file is identical.

The query-aware RoPE rounding travels with the result: every layer's query moment (measured in its block, after
folding) and, by default, the post-RoPE rotation ``quantmla calibrate`` stores beside it (``rope_rotation``,
:func:`quantmla.calibrate.query_moments.rope_rotations`), both in the transforms file and in the delta (which ``quantmla
merge`` turns into the merged folder's rounding file). The rotation is added when the last block is done (it depends
on no block's data), so it is no part of the recipe a resumed run must match.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantmla.calibrate.blocks import attention_by_block, decoder_blocks, first_block_inputs, resolve_device, run_block
from quantmla.calibrate.checkpoint import (
    CheckpointReader,
    base_key,
    load_config,
    load_module_tensors,
    meta_model,
    rebuild_nonpersistent_buffers,
    tensor_digest,
)
from quantmla.calibrate.config import CalibrationConfig, recorded_rope_weighting
from quantmla.calibrate.delta import atomic_save_safetensors, folded_tensor_names, save_delta, tokens_digest
from quantmla.calibrate.fuse import fold_transforms
from quantmla.calibrate.query_moments import layer_query_moment, moments_in, rope_rotations, rounding_file_tensors
from quantmla.calibrate.shipped import layer_transforms, save_transforms, transforms_tensors
from quantmla.calibrate.trainer import LayerBanks, _check_policy_coverage, _token_bank, calibrate_attention
from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import MLASpec
from quantmla.quant.formats import CacheFormat, get_format

PROGRESS = "progress.json"
BANK = "bank.pt"
STREAM_VERSION = 1
TF_PREFIX = "quantmla.transforms."  # transforms' tensors inside the per-block parts
THIN = "thin"  # part metadata: "1" = the block's transforms only (folded again on resume)
ROUNDING_NAMES = (".rope.query_moment", ".rope.post_rotation")  # the transforms the delta carries into `merge`


@dataclass
class StreamReport:
    """Per-block costs (seconds to load, run and calibrate; resident memory) and the per-layer reports. A resumed
    run's ``blocks`` start with the ``resumed_blocks`` finished by earlier calls (their costs as recorded then);
    ``seconds`` is this call's wall time."""

    blocks: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    bank_bytes: int = 0
    block_bytes_max: int = 0
    seconds: float = 0.0
    resumed_blocks: int = 0
    rope_rounding: dict | None = None  # the record quantmla.json gets from `quantmla calibrate` (None: no RoPE path)

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "layers": self.layers, "bank_bytes": self.bank_bytes,
                "block_bytes_max": self.block_bytes_max, "seconds": self.seconds,
                "resumed_blocks": self.resumed_blocks, "rope_rounding": self.rope_rounding}  # fmt: skip


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes (Linux ``/proc``; (0, 0) elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            kv = dict(line.split(":", 1) for line in f if ":" in line)
        return int(kv["VmRSS"].split()[0]) * 1024, int(kv["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def _recipe(fmt: CacheFormat, config: CalibrationConfig, dtype: torch.dtype, tokens: torch.Tensor) -> dict:
    cal = {k: v for k, v in config.to_dict().items() if k != "progress"}
    return {"cache_format": fmt.to_dict(), "method": config.method, "calibration": cal, "dtype": str(dtype),
            "tokens_sha1": tokens_digest(tokens), "tokens_shape": list(tokens.shape), "stream_version": STREAM_VERSION}


def _digest(d: dict) -> str:
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def _save_bank(path: Path, h: torch.Tensor) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(h, tmp)
    os.replace(tmp, path)


def _recipe_changes(old: dict | None, new: dict) -> str:
    """What differs between a stored recipe and this call's, e.g. ``calibration.seed 0 -> 1`` (empty when the
    progress predates stored recipes); a RoPE objective recorded before the option existed is the paper's."""
    if not isinstance(old, dict):
        return ""
    cal = old.get("calibration", {})
    old = {**old, "calibration": {**cal, "rope_weighting": recorded_rope_weighting(cal)}}
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{j} {a.get(j)!r} -> {b.get(j)!r}" for j in sorted(set(a) | set(b)) if a.get(j) != b.get(j)]
        elif a != b:
            out.append(f"{k} {'(changed)' if k.startswith('tokens') else f'{a!r} -> {b!r}'}")
    hint = ""
    if any(c.startswith("calibration.rope_weighting 'uniform' -> 'attention'") for c in out):
        hint = " (the default RoPE objective became 'attention': pass --rope-weighting uniform to continue this run)"
    return "; ".join(out) + hint


def _prepare_work(work: Path, resume: bool, force: bool, stamp: dict, recipe: dict | None = None) -> int:
    """Create / check the work directory (``recipe`` is stored beside the stamp, so a mismatch can say what
    changed); return the number of blocks already finished."""
    if work.exists():
        if resume:
            try:
                with open(work / PROGRESS) as f:
                    prog = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise RuntimeError(f"{work}: cannot read {PROGRESS} ({e}); start over with --force") from None
            for k in ("recipe_sha1", "base_key"):
                if prog.get(k) != stamp[k]:
                    what = _recipe_changes(prog.get("recipe"), recipe) if k == "recipe_sha1" and recipe else ""
                    raise ValueError(
                        f"{work} holds progress of another run ({k} differs{': ' + what if what else ''}): resume "
                        "with the same model, format, calibration settings and text, or start over with --force"
                    )
            return int(prog["blocks_done"])
        if not force:
            raise FileExistsError(
                f"{work} holds an earlier run's progress: pass --resume to continue it or --force to start over"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True)
    _write_json(work / PROGRESS, {**stamp, "recipe": recipe, "blocks_done": 0, "blocks": []})
    return 0


def calibrate_streamed(
    model_dir: str | os.PathLike,
    fmt: CacheFormat | str,
    tokens: torch.Tensor,
    config: CalibrationConfig | None = None,
    out: str | os.PathLike = "quantmla-delta.safetensors",
    *,
    work: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.bfloat16,
    resume: bool = False,
    force: bool = False,
    keep_work: bool = False,
    transforms_out: str | os.PathLike | None = None,
    on_block_done: Callable[[int], None] | None = None,
    rope_rotation: str = "hadamard",
) -> StreamReport:
    """Calibrate the checkpoint in ``model_dir`` block by block and write the delta to ``out``.

    ``tokens``: calibration token ids [N >= train_seqs + val_seqs, >= seq_len]. ``dtype``: the dtype the weights are
    materialized and the blocks run in (BF16 for the big FP8 models; the in-memory equivalent is the model loaded
    in that dtype). ``resume``: continue an interrupted run from its work directory. ``force``: overwrite ``out``
    and discard a previous work directory. ``transforms_out``: also write the learned transforms (a small file,
    :mod:`.shipped`). ``on_block_done(b)`` is called after block ``b`` is committed to disk. ``rope_rotation``:
    hadamard (default) or none, the post-RoPE rotation stored beside each layer's query moment, in the transforms
    file and the delta, and recorded in their metadata (``rope_rounding``) as ``quantmla calibrate`` does.
    """
    rope_rotations({}, rope_rotation)  # an unknown kind fails here, before any work
    config = config or CalibrationConfig()
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    work = Path(work) if work is not None else out.with_name(out.name + ".work")
    reader = CheckpointReader(model_dir, dtype)
    hf_config = load_config(model_dir)
    spec = MLASpec.from_config(hf_config)
    fmt = get_format(fmt).adapted(spec.kv_lora_rank, spec.qk_rope_head_dim)
    fmt.check_dims(spec.kv_lora_rank, spec.qk_rope_head_dim)
    device = resolve_device(config.device)
    tokens = _token_bank(tokens, config)
    _check_policy_coverage(int(tokens.shape[1]), config)
    recipe = _recipe(fmt, config, dtype, tokens)
    stamp = {"recipe_sha1": _digest(recipe), "base_key": base_key(model_dir)}
    start = _prepare_work(work, resume, force and not resume, stamp, recipe)

    t_start = time.time()
    model = meta_model(hf_config, dtype)
    base, blocks = decoder_blocks(model)
    prefix = next(name + "." for name, m in model.named_modules() if m is base) if base is not model else ""
    rebuild_nonpersistent_buffers(base, hf_config)
    for name, child in base.named_children():
        if name != "layers" and any(p.is_meta for p in child.parameters()):
            load_module_tensors(child, f"{prefix}{name}.", reader)
    reader.close()
    attn_of_block = attention_by_block(model, blocks)
    h, block_kwargs = first_block_inputs(model, tokens, config.batch_size, device)
    for name, child in base.named_children():
        if name != "layers":
            child.to("meta")  # the embedding is needed for block 0's inputs only
    if start:
        h = _replay_finished(start, blocks, attn_of_block, work, reader, prefix, spec, h, block_kwargs, config, device)
    report = StreamReport(bank_bytes=3 * h.numel() * h.element_size(), resumed_blocks=start)
    if start:
        with open(work / PROGRESS) as f:
            report.blocks = list(json.load(f)["blocks"][:start])  # the earlier calls' blocks, costs as recorded
    n_train = config.train_seqs
    for b in range(start, len(blocks)):
        block, stats = blocks[b], {"block": b}
        t0 = time.time()
        load_module_tensors(block, f"{prefix}layers.{b}.", reader, device)
        names = [n for a in attn_of_block[b] for n in folded_tensor_names(a, _name_in(a, block, b, prefix))]
        digests = {n: tensor_digest([reader.raw(s) for s in reader.source_names(n)]) for n in names}
        reader.close()
        block_bytes = sum(t.numel() * t.element_size() for t in block.state_dict().values())
        report.block_bytes_max = max(report.block_bytes_max, block_bytes)
        stats.update(load_s=time.time() - t0, block_bytes=block_bytes)
        t1 = time.time()
        h_next, attn_inputs, pe = run_block(block, attn_of_block[b], h, block_kwargs, config.batch_size, device)
        cos, sin = cos_sin_from_position_embeddings(pe)
        cos, sin = cos[:1].float(), sin[:1].float()
        stats["forward_s"] = time.time() - t1
        t2 = time.time()
        reports, tf = [], {}
        for attn, x in zip(attn_of_block[b], attn_inputs, strict=True):
            banks = LayerBanks(x[:n_train], x[n_train:], cos, sin)
            content, rope, rep = calibrate_attention(attn, spec, fmt, banks, config, device, attn.layer_idx)
            fold_transforms(attn, spec, content, rope)
            reports.append(asdict(rep))
            moment = None  # the folded layer's query moment: the query-aware RoPE rounding the transforms file carries
            if fmt.rope is not None:  # in every part, so a resumed run's transforms file has every layer's
                moment = layer_query_moment(attn, spec, x[:n_train], cos, sin, sink=config.sink, local=config.local,
                                            batch_size=config.batch_size)  # fmt: skip
            tf.update({TF_PREFIX + k: v for k, v in transforms_tensors(attn.layer_idx, content, rope, moment).items()})
        del attn_inputs
        stats["calibrate_s"] = time.time() - t2
        state, local = block.state_dict(), f"{prefix}layers.{b}."
        part = {n: state[n[len(local) :]].detach().to("cpu").clone() for n in names} | tf
        del state, banks, x  # no reference to the block's weights or banks may outlive it
        atomic_save_safetensors(part, part_path(work, b),
                                {"digests": json.dumps(digests), "reports": json.dumps(reports)})
        _save_bank(work / BANK, h_next)
        block.to("meta")
        h = h_next
        stats["rss_bytes"], stats["peak_rss_bytes"] = rss_bytes()
        stats["seconds"] = time.time() - t0
        report.blocks.append(stats)
        with open(work / PROGRESS) as f:
            prog = json.load(f)
        prog.update(blocks_done=b + 1, blocks=prog["blocks"] + [stats])
        _write_json(work / PROGRESS, prog)
        if on_block_done is not None:
            on_block_done(b)
    tensors, digests, layers = _assemble(work, len(blocks))
    transforms = {k[len(TF_PREFIX) :]: tensors.pop(k) for k in list(tensors) if k.startswith(TF_PREFIX)}
    rotations, record = rope_rotations(moments_in(transforms), rope_rotation)  # as `quantmla calibrate` chooses
    transforms.update(rounding_file_tensors({}, rotations))  # layers.i.rope.post_rotation beside each moment
    report.layers = layers
    report.seconds = time.time() - t_start
    meta = {"base_key": stamp["base_key"], "base_digests": digests, "recipe": recipe, "report": layers,
            "model_type": spec.model_type, "num_blocks": len(blocks)}
    if fmt.rope is not None:
        meta["rope_rounding"] = report.rope_rounding = record
    rounding = {k: v for k, v in transforms.items() if k.endswith(ROUNDING_NAMES)}  # carried into `merge`
    save_delta(out, tensors, meta, force=force, rounding=rounding)
    if transforms_out is not None:
        tmeta = {"base_key": stamp["base_key"], "cache_format": recipe["cache_format"], "method": config.method,
                 "calibration": recipe["calibration"], "dtype": recipe["dtype"]}  # fmt: skip
        if fmt.rope is not None:
            tmeta["rope_rounding"] = record
        save_transforms(transforms_out, transforms, tmeta, force=force)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return report


def part_path(work: Path, b: int) -> Path:
    return Path(work) / f"block_{b:05d}.safetensors"


def _part(work: Path, b: int) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(part_path(work, b), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _replay_finished(start, blocks, attn_of_block, work, reader, prefix, spec, h, block_kwargs, config, device):
    """Before resuming at block ``start``: the hidden states entering it (``bank.pt``, or recomputed through the
    finished blocks with their original weights, as the first pass computed them) and full parts for thin ones."""
    have_bank = (work / BANK).exists()
    thin = {b for b in range(start) if _part(work, b)[1].get(THIN) == "1"}
    for b in range(start if not have_bank else max(thin, default=-1) + 1):
        if have_bank and b not in thin:
            continue
        block = blocks[b]
        load_module_tensors(block, f"{prefix}layers.{b}.", reader, device)
        reader.close()
        if not have_bank:
            h, attn_inputs, _ = run_block(block, attn_of_block[b], h, block_kwargs, config.batch_size, device)
            del attn_inputs
        if b in thin:  # fold the block's stored transforms into its base weights, keep the changed tensors
            tf, meta = _part(work, b)
            plain = {k[len(TF_PREFIX) :]: v for k, v in tf.items()}
            names = []
            for attn in attn_of_block[b]:
                fold_transforms(attn, spec, *layer_transforms(attn, spec, plain, attn.layer_idx))
                names += folded_tensor_names(attn, _name_in(attn, block, b, prefix))
            state, local = block.state_dict(), f"{prefix}layers.{b}."
            part = {n: state[n[len(local) :]].detach().to("cpu").clone() for n in names} | tf
            del state
            atomic_save_safetensors(part, part_path(work, b), {k: v for k, v in meta.items() if k != THIN})
        block.to("meta")
    if have_bank:
        return torch.load(work / BANK, weights_only=True)
    _save_bank(work / BANK, h)
    return h


def _name_in(attn: nn.Module, block: nn.Module, b: int, prefix: str) -> str:
    """Checkpoint prefix of ``attn`` inside block ``b`` (``model.layers.b.self_attn.`` or ``...self_attn.0.``)."""
    for name, m in block.named_modules():
        if m is attn:
            return f"{prefix}layers.{b}.{name}."
    raise RuntimeError("attention module not found in its block")  # pragma: no cover


def _assemble(work: Path, num_blocks: int) -> tuple[dict, dict, list]:
    from safetensors import safe_open

    tensors, digests, layers = {}, {}, []
    for b in range(num_blocks):
        with safe_open(part_path(work, b), framework="pt") as f:
            meta = f.metadata()
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
        digests.update(json.loads(meta["digests"]))
        layers.extend(json.loads(meta["reports"]))
    return tensors, digests, layers


__all__ = ["StreamReport", "calibrate_streamed", "part_path", "rss_bytes"]
