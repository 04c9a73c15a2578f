"""Running a decoder model block by block: the hidden states entering block 0, then each block's outputs and the
inputs of its MLA attention modules (forward pre-hooks), with only the current block on the accelerator and the
captured banks on the CPU. Used by calibration (:mod:`quantmla.calibrate.trainer`, :mod:`quantmla.calibrate.stream`)
and the error analysis (:mod:`quantmla.analysis`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from quantmla.mla.rope import cos_sin_from_position_embeddings
from quantmla.mla.spec import UnsupportedModelError
from quantmla.mla.weights import iter_mla_attention


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU (checked only when called, never at import)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return dev


def decoder_blocks(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__}: cannot find the decoder blocks (model.model.layers)")
    return base, layers


class _Stop(Exception):
    pass


def first_block_inputs(
    model: nn.Module, tokens: torch.Tensor, batch: int, device: torch.device
) -> tuple[torch.Tensor, dict]:
    """Hidden states entering block 0 for every sequence ([N, T, D] on the CPU) and the block's other kwargs."""
    base, layers = decoder_blocks(model)
    store: dict[str, Any] = {}

    def hook(_mod, args, kwargs):
        store["h"] = args[0] if args else kwargs["hidden_states"]
        store["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    others = [m for name, m in base.named_children() if name != "layers"]
    homes = [device_of(m) for m in others]
    for m in others:
        m.to(device)
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    hs, kwargs = [], None
    try:
        for i in range(0, tokens.shape[0], batch):
            try:
                with torch.no_grad():
                    base(input_ids=tokens[i : i + batch].to(device), use_cache=False)
            except _Stop:
                pass
            hs.append(store["h"].detach().cpu())
            if kwargs is None:
                kwargs = store["kw"]
    finally:
        handle.remove()
        for m, home in zip(others, homes, strict=True):
            if home is not None:
                m.to(home)
    kwargs = dict(kwargs or {})
    for k in ("cache", "past_key_values", "past_key_value"):
        if k in kwargs:
            kwargs[k] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return torch.cat(hs), kwargs


def device_of(m: nn.Module) -> torch.device | None:
    for p in m.parameters():
        return p.device
    for b in m.buffers():
        return b.device
    return None


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


@torch.no_grad()
def run_block(
    block: nn.Module, attns: list[nn.Module], h: torch.Tensor, kwargs: dict, batch: int, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    """Run ``h`` [N, T, D] through ``block``; return its outputs and each attention module's inputs (CPU)."""
    captured: list[list[torch.Tensor]] = [[] for _ in attns]
    pos: dict[str, Any] = {}

    def make_hook(k):
        def hook(_mod, args, kw):
            x = args[0] if args else kw["hidden_states"]
            captured[k].append(x.detach().cpu())
            if "pe" not in pos and kw.get("position_embeddings") is not None:
                pos["pe"] = _to(kw["position_embeddings"], torch.device("cpu"))

        return hook

    handles = [a.register_forward_pre_hook(make_hook(k), with_kwargs=True) for k, a in enumerate(attns)]
    outs = []
    kw_dev = _to(kwargs, device)
    try:
        for i in range(0, h.shape[0], batch):
            out = block(h[i : i + batch].to(device), **kw_dev)
            out = out[0] if isinstance(out, tuple) else out
            outs.append(out.detach().cpu())
    finally:
        for hd in handles:
            hd.remove()
    if "pe" not in pos:
        raise UnsupportedModelError("the attention modules did not receive position_embeddings; unsupported model")
    return torch.cat(outs), [torch.cat(c) for c in captured], pos["pe"]


def progress_over(it: Iterable, desc: str, enabled: bool):
    if not enabled:
        return it
    from quantmla.progress import progress  # tqdm on a terminal, a compact line with the time left otherwise

    return progress(it, desc)


def iter_attention_inputs(
    model: nn.Module, tokens: torch.Tensor, batch_size: int, device: torch.device, progress: bool = False
):
    """Yield ``(attention_module, inputs [N, T, D] on the CPU, cos [1, T, Dr/2], sin)`` for every MLA attention
    module in order, running the sequences ``tokens`` [N, T] block by block with only the current block on
    ``device``. The consumer may modify the module (e.g. fold transforms) before asking for the next one, as long
    as the block's full-precision function is unchanged: the next block's inputs are computed beforehand."""
    _, blocks = decoder_blocks(model)
    attn_of_block = attention_by_block(model, blocks)
    h, block_kwargs = first_block_inputs(model, tokens, batch_size, device)
    for b, block in enumerate(progress_over(blocks, "layers", progress)):
        home = device_of(block)
        block.to(device)
        try:
            h_next, attn_inputs, pe = run_block(block, attn_of_block[b], h, block_kwargs, batch_size, device)
            cos, sin = cos_sin_from_position_embeddings(pe)
            cos, sin = cos[:1].float(), sin[:1].float()  # same positions for every sequence
            for attn, x in zip(attn_of_block[b], attn_inputs, strict=True):
                yield attn, x, cos, sin
            h = h_next
        finally:
            if home is not None:
                block.to(home)


def attention_by_block(model: nn.Module, blocks: nn.ModuleList) -> list[list[nn.Module]]:
    attns = [a for _, a in iter_mla_attention(model)]
    out = []
    for block in blocks:
        members = {id(m) for m in block.modules()}
        out.append([a for a in attns if id(a) in members])
    if sum(len(a) for a in out) != len(attns):
        raise UnsupportedModelError("some MLA attention modules are outside model.model.layers")
    return out
