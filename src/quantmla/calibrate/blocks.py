"""Running a decoder model block by block: the hidden states entering block 0, then each block's outputs and the
inputs of its MLA attention modules (forward pre-hooks), with only the current block on the accelerator and the
captured banks on the CPU (in page-locked memory when the block runs on a GPU: a copy between the GPU and pageable
memory runs at a few GB/s, ~1-1.5 s per SmolLM2 block at the paper's banks, and makes the host wait). Used by
calibration (:mod:`quantmla.calibrate.trainer`, :mod:`quantmla.calibrate.stream`) and the error analysis
(:mod:`quantmla.analysis`)."""

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
    hs, kwargs = HostBank(tokens.shape[0]), None
    try:
        for i in range(0, tokens.shape[0], batch):
            try:
                with torch.no_grad():
                    base(input_ids=tokens[i : i + batch].to(device), use_cache=False)
            except _Stop:
                pass
            hs.append(store["h"].detach())
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
    return hs.result(), kwargs


class HostBank:
    """Batches [b, ...] of a bank of ``n`` rows gathered on the CPU in order: a device batch is copied without a
    host wait into one page-locked [n, ...] buffer (allocated at the first batch), a CPU batch into a pageable one.
    ``result()`` waits for the copies and returns the [n, ...] bank. Values are the batches' exactly."""

    def __init__(self, n: int):
        self.n, self.buf, self.rows = n, None, 0
        self.gpu: torch.device | None = None  # the device of the copies still in flight

    def append(self, x: torch.Tensor) -> None:
        if self.buf is None:
            self.buf = _host_buffer((self.n, *x.shape[1:]), x.dtype, pin=x.is_cuda)
        if self.rows + x.shape[0] > self.n or tuple(x.shape[1:]) != tuple(self.buf.shape[1:]):
            raise ValueError(f"bank batch {tuple(x.shape)} does not fit the bank {tuple(self.buf.shape)} at row "
                             f"{self.rows}")  # fmt: skip
        async_copy = x.is_cuda and self.buf.is_pinned()
        self.buf[self.rows : self.rows + x.shape[0]].copy_(x, non_blocking=async_copy)
        self.gpu = x.device if async_copy else self.gpu
        self.rows += x.shape[0]

    def result(self) -> torch.Tensor:
        if self.buf is None or self.rows != self.n:
            raise ValueError(f"bank of {self.n} rows got {self.rows}")
        if self.gpu is not None:
            torch.cuda.synchronize(self.gpu)  # the non-blocking copies have landed before the host reads the bank
        return self.buf


def _host_buffer(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An empty CPU tensor, page-locked when asked and the allocation succeeds (pageable otherwise)."""
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # page-locked memory exhausted or refused: the pageable path, slower but the same
            pass
    return torch.empty(shape, dtype=dtype)


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
    n = h.shape[0]
    captured = [HostBank(n) for _ in attns]
    pos: dict[str, Any] = {}

    def make_hook(k):
        def hook(_mod, args, kw):
            x = args[0] if args else kw["hidden_states"]
            captured[k].append(x.detach())
            if "pe" not in pos and kw.get("position_embeddings") is not None:
                pos["pe"] = _to(kw["position_embeddings"], torch.device("cpu"))

        return hook

    handles = [a.register_forward_pre_hook(make_hook(k), with_kwargs=True) for k, a in enumerate(attns)]
    outs = HostBank(n)
    kw_dev = _to(kwargs, device)
    try:
        for i in range(0, n, batch):
            out = block(h[i : i + batch].to(device, non_blocking=True), **kw_dev)  # async from a pinned bank
            out = out[0] if isinstance(out, tuple) else out
            outs.append(out.detach())
    finally:
        for hd in handles:
            hd.remove()
    if "pe" not in pos:
        raise UnsupportedModelError("the attention modules did not receive position_embeddings; unsupported model")
    return outs.result(), [c.result() for c in captured], pos["pe"]


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
