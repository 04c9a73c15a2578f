"""Reading a (possibly huge, sharded, FP8 block-scaled) checkpoint one module at a time.

DeepSeek-V3 (671B) and Kimi-K2 (1T) ship as ~160 safetensors shards listed in ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file). Their linear weights are FP8 (``float8_e4m3fn``) with one fp32
``<name>_scale_inv`` per 128 x 128 block (``quantization_config.weight_block_size``; the last block of a row or
column may be partial, e.g. 576 = 4.5 blocks): the real weight is ``fp8 * scale_inv`` block-wise
(:func:`dequantize_fp8_blocks`). Norms, embeddings, the router and ``lm_head`` are stored in BF16.

:class:`CheckpointReader` opens shards memory-mapped on demand (``safe_open``) and reads single tensors, so a
decoder block's weights can be materialized without touching the rest; :meth:`CheckpointReader.close` unmaps
them. :func:`load_module_tensors` fills a module built on the ``meta`` device from the checkpoint, dequantizing
FP8 weights and stacking per-expert tensors into transformers' fused expert parameters (``experts.gate_up_proj``
[E, 2I, D] = per expert ``cat(gate_proj, up_proj)``; ``experts.down_proj`` [E, D, I]), the layout transformers'
own loader builds from the same files. :func:`meta_model` builds the whole model without memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2 ships DeepSeek-V3's architecture under its own name
_GATE_UP = re.compile(r"^(?P<p>.*\.experts)\.gate_up_proj$")
_DOWN = re.compile(r"^(?P<p>.*\.experts)\.down_proj$")


class CheckpointError(ValueError):
    """The checkpoint is incomplete, inconsistent or not what the model expects."""


def dequantize_fp8_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``w`` [R, C] (FP8) times its per-block ``scale_inv`` [ceil(R / b0), ceil(C / b1)] (fp32), in fp32, cast to
    ``dtype``. The last block row / column may be partial."""
    if w.dim() != 2 or scale_inv.dim() != 2:
        raise CheckpointError(
            f"FP8 block dequantization needs 2-D tensors, got {tuple(w.shape)} / {tuple(scale_inv.shape)}"
        )
    (r, c), (b0, b1) = w.shape, block
    want = (-(-r // b0), -(-c // b1))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"weight {tuple(w.shape)} with {b0}x{b1} blocks needs scale_inv of shape {want}, "
            f"got {tuple(scale_inv.shape)}"
        )
    s = scale_inv.to(device=w.device, dtype=torch.float32)
    s = s.repeat_interleave(b0, 0)[:r].repeat_interleave(b1, 1)[:, :c]  # [R, C]
    return (w.to(torch.float32) * s).to(dtype)


class CheckpointReader:
    """Tensors of a local safetensors checkpoint (one file or an index of shards), read one at a time.

    ``dtype``: what floating tensors are returned as (FP8 weights are dequantized first). Shards are opened
    memory-mapped when first needed and stay open until :meth:`close`.
    """

    def __init__(self, model_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16):
        self.dir = Path(model_dir)
        self.dtype = dtype
        self.config = read_config_dict(self.dir)
        index = self.dir / INDEX_NAME
        if index.exists():
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif (self.dir / SINGLE_NAME).exists():
            from safetensors import safe_open

            with safe_open(self.dir / SINGLE_NAME, framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_NAME)
        else:
            raise CheckpointError(f"{self.dir}: no {INDEX_NAME} nor {SINGLE_NAME}; is this a safetensors checkpoint?")
        missing = sorted({s for s in self.weight_map.values() if not (self.dir / s).exists()})
        if missing:
            raise CheckpointError(f"{self.dir}: shard(s) listed in the index are missing: {missing[:3]}")
        q = self.config.get("quantization_config") or {}
        self.block = tuple(q.get("weight_block_size") or (128, 128))
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        from safetensors import safe_open

        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.dir}: the checkpoint has no tensor {name!r}")
        if shard not in self._open:
            self._open[shard] = safe_open(self.dir / shard, framework="pt", device="cpu")
        return self._open[shard]

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor, as stored (no dequantization, no cast)."""
        return self._handle(name).get_tensor(name)

    def is_fp8(self, name: str) -> bool:
        return name + SCALE_SUFFIX in self.weight_map

    def read(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """``name`` on ``device``: FP8 weights dequantized with their block scales, floats cast to ``dtype``."""
        t = self.raw(name).to(device)
        if self.is_fp8(name):
            if t.dtype not in FP8_DTYPES:
                raise CheckpointError(f"{name} has a {SCALE_SUFFIX} but is stored as {t.dtype}, not FP8")
            return dequantize_fp8_blocks(t, self.raw(name + SCALE_SUFFIX), self.block, self.dtype)
        if t.dtype in FP8_DTYPES:
            raise CheckpointError(f"{name} is FP8 but the checkpoint has no {name + SCALE_SUFFIX}")
        return t.to(self.dtype) if t.is_floating_point() else t

    def source_names(self, name: str) -> list[str]:
        """The stored tensors (scales included) that :meth:`read` of ``name`` uses."""
        return [name, name + SCALE_SUFFIX] if self.is_fp8(name) else [name]

    def close(self) -> None:
        """Unmap every open shard."""
        self._open.clear()


def read_config_dict(model_dir: str | os.PathLike) -> dict:
    p = Path(model_dir) / "config.json"
    if not p.exists():
        raise CheckpointError(f"{model_dir}: no config.json; pass a model directory")
    with open(p) as f:
        return json.load(f)


def load_config(model_dir: str | os.PathLike):
    """The transformers config of ``model_dir`` without its ``quantization_config`` (weights are dequantized on
    load); Kimi-K2's ``kimi_k2`` is read as ``deepseek_v3`` (same architecture, no remote code)."""
    from transformers import AutoConfig

    try:
        import quantmla.models.mla_model  # noqa: F401  (registers quantmla_mla)
    except ImportError:  # pragma: no cover
        pass
    d = read_config_dict(model_dir)
    for k in ("quantization_config", "auto_map", "architectures", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    if "model_type" not in d:
        raise CheckpointError(f"{model_dir}/config.json has no model_type")
    model_type = d.pop("model_type")
    return AutoConfig.for_model(MODEL_TYPE_ALIASES.get(model_type, model_type), **d)


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with every parameter on the ``meta`` device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def rebuild_nonpersistent_buffers(module: nn.Module, config) -> None:
    """Replace children whose non-persistent buffers live on ``meta`` (RoPE ``inv_freq``) by fresh CPU copies
    built from ``config`` (their buffers are computed from it, not stored in checkpoints)."""
    for name, child in list(module.named_children()):
        persistent = set(child.state_dict().keys())
        stale = [n for n, b in child.named_buffers(recurse=False) if b.is_meta and n not in persistent]
        if stale:
            try:
                fresh = type(child)(config=config)
            except TypeError as e:
                raise CheckpointError(f"cannot rebuild {name} ({type(child).__name__}) from the config: {e}") from e
            setattr(module, name, fresh)
        else:
            rebuild_nonpersistent_buffers(child, config)


@torch.no_grad()
def load_module_tensors(
    module: nn.Module, prefix: str, reader: CheckpointReader, device: torch.device | str = "cpu"
) -> list[str]:
    """Materialize ``module`` (built on ``meta``) on ``device`` from the checkpoint tensors under ``prefix``
    (e.g. ``"model.layers.3."``). Returns the stored tensor names read (FP8 scales included). Raises
    :class:`CheckpointError` when a parameter has no tensor or a tensor's shape does not match."""
    module.to_empty(device=device)
    used: list[str] = []
    for name, dst in module.state_dict(keep_vars=True).items():
        full = prefix + name
        if full in reader:
            pieces = [((), full)]
        elif m := _GATE_UP.match(full):  # [E, 2I, D]: expert e's gate_proj rows, then its up_proj rows
            half = dst.shape[1] // 2
            pieces = [((e, slice(i * half, (i + 1) * half)), f"{m['p']}.{e}.{proj}.weight")
                      for e in range(dst.shape[0]) for i, proj in enumerate(("gate_proj", "up_proj"))]  # fmt: skip
        elif m := _DOWN.match(full):  # [E, D, I]
            pieces = [((e,), f"{m['p']}.{e}.down_proj.weight") for e in range(dst.shape[0])]
        else:
            raise CheckpointError(f"{reader.dir}: no checkpoint tensor for {full!r} (another model or a broken index?)")
        for where, key in pieces:  # one stored tensor in memory at a time
            if key not in reader:
                raise CheckpointError(f"{reader.dir}: no checkpoint tensor for {key!r}")
            src, target = reader.read(key, device), dst[where]
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointError(f"{key}: checkpoint {tuple(src.shape)} != model {tuple(target.shape)}")
            target.copy_(src)
            used += reader.source_names(key)
            del src
    return used


def load_full_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """The whole model of ``model_dir`` through :class:`CheckpointReader` (FP8 weights dequantized to ``dtype``):
    for checkpoints transformers cannot dequantize on this machine, and small models only (all in memory)."""
    reader = CheckpointReader(model_dir, dtype)
    config = load_config(model_dir)
    model = meta_model(config, dtype)
    rebuild_nonpersistent_buffers(model, config)
    for name, child in model.named_children():
        load_module_tensors(child, f"{name}.", reader, device)
    reader.close()
    return model.to(device)


def base_key(model_dir: str | os.PathLike) -> str:
    """A fingerprint of a checkpoint from its config and tensor directory (names, dtypes, shapes; headers only):
    ``<dir name>-<sha1[:12]>``. Deltas record it so that they are never applied to another model."""
    from safetensors import safe_open

    d = Path(model_dir)
    reader = CheckpointReader(d)
    h = hashlib.sha1(json.dumps(reader.config, sort_keys=True).encode())
    for shard in sorted(set(reader.weight_map.values())):
        with safe_open(d / shard, framework="pt") as f:
            for k in sorted(f.keys()):
                s = f.get_slice(k)
                h.update(f"{k}:{s.get_dtype()}:{s.get_shape()};".encode())
    return f"{d.resolve().name}-{h.hexdigest()[:12]}"


def tensor_digest(tensors: list[torch.Tensor]) -> str:
    """sha1 of the raw bytes of ``tensors`` (in order): identifies the base weights a delta replaced."""
    h = hashlib.sha1()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "base_key",
    "dequantize_fp8_blocks",
    "load_config",
    "load_full_model",
    "load_module_tensors",
    "meta_model",
    "rebuild_nonpersistent_buffers",
    "tensor_digest",
]
