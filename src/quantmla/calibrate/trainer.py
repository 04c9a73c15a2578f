"""Layer-by-layer calibration: capture each attention layer's inputs, learn (or set) its transforms, fold them.

:func:`calibrate_model` walks the decoder blocks in order. For each block it moves only that block to the
accelerator, runs the calibration sequences through it (the block's inputs are the previous block's outputs,
already fused -- fusion preserves full precision, so they equal the original model's), records the hidden states
that enter each of its attention modules with forward pre-hooks, and then, per attention module and path,
builds the transform the configured method asks for, folds it into the weights in place and moves the block back.
Memory on the accelerator: one block plus one batch of activations; the banks of captured hidden states live on
the CPU in the model's dtype.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from quantmla.calibrate import baselines
from quantmla.calibrate.blocks import iter_attention_inputs, progress_over, resolve_device
from quantmla.calibrate.config import CalibrationConfig
from quantmla.calibrate.fuse import fold_transforms, latent_norm_gain
from quantmla.calibrate.objectives import (
    LayerInputs,
    content_objective,
    layer_inputs,
    reference_output,
    rope_objective,
    sample_queries,
)
from quantmla.calibrate.query_moments import layer_query_moment
from quantmla.calibrate.transforms import ContentTransform, RopeTransform
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import MLALayerWeights, extract_layer_weights
from quantmla.quant.formats import CacheFormat, get_format

TRAIN_CACHE_BYTES = 1 << 30  # project the training bank once when its fp32 inputs (all queries) fit in this

# ---- report --------------------------------------------------------------------------------------------------


@dataclass
class LayerReport:
    """Validation NMSE of each candidate transform per path, the chosen one, and the training curve ends."""

    layer: int
    content: dict = field(default_factory=dict)
    rope: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class CalibrationReport:
    method: str
    format: str
    config: dict
    num_train: int
    num_val: int
    seq_len: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    # {cache layer: H [Dr, Dr] fp32} when calibrate_model was asked for them (not part of the report's JSON)
    query_moments: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        out = asdict(replace(self, query_moments={}))  # (asdict would deep-copy the moments)
        del out["query_moments"]
        return out

    def summary(self) -> dict:
        """Mean validation NMSE per path: the identity (RTN) and the chosen transform."""
        out: dict[str, Any] = {"method": self.method, "format": self.format, "layers": len(self.layers)}
        for path in ("content", "rope"):
            rows = [getattr(r, path) for r in self.layers if getattr(r, path)]
            if rows:
                out[f"{path}_val_identity"] = sum(r["val_identity"] for r in rows) / len(rows)
                out[f"{path}_val_chosen"] = sum(r["val_chosen"] for r in rows) / len(rows)
        out["seconds"] = round(self.seconds, 2)
        return out


# ---- devices, banks, capture ---------------------------------------------------------------------------------


def _token_bank(calib_token_batches: Any, config: CalibrationConfig) -> torch.Tensor:
    if isinstance(calib_token_batches, torch.Tensor):
        tokens = calib_token_batches
    else:
        parts = [torch.as_tensor(b) for b in calib_token_batches]
        if not parts:
            raise ValueError("no calibration tokens given")
        tokens = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
    if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"calibration tokens must be integer [N, T], got {tuple(tokens.shape)} {tokens.dtype}")
    need = config.train_seqs + config.val_seqs
    if tokens.shape[0] < need:
        raise ValueError(
            f"need {need} calibration sequences ({config.train_seqs} train + {config.val_seqs} validation, disjoint), "
            f"got {tokens.shape[0]}; provide more text or lower train_seqs/val_seqs"
        )
    return tokens[:need, : config.seq_len].long()


# ---- per-layer learning --------------------------------------------------------------------------------------


def warmup_cosine(steps: int, warmup_frac: float):
    """LambdaLR factor: linear warmup over ``warmup_frac * steps`` steps, then cosine decay to 0."""
    warm = max(1, int(round(warmup_frac * steps))) if warmup_frac > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        rest = max(1, steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / rest)))

    return f


@dataclass
class LayerBanks:
    """One attention module's calibration data: input hidden states (CPU) and per-pair RoPE angles."""

    train: torch.Tensor  # [Ntrain, T, D]
    val: torch.Tensor  # [Nval, T, D]
    cos: torch.Tensor  # [1, T, Dr/2]
    sin: torch.Tensor  # [1, T, Dr/2]


class LayerProblem:
    """The objectives of one attention module on its banks, evaluated on ``device`` in fp32."""

    def __init__(
        self,
        w: MLALayerWeights,
        spec: MLASpec,
        banks: LayerBanks,
        fmt: CacheFormat,
        config: CalibrationConfig,
        device: torch.device,
        seed: int,
    ):
        self.w, self.spec, self.banks, self.fmt, self.config, self.device = w, spec, banks, fmt, config, device
        self.cos, self.sin = banks.cos.to(device), banks.sin.to(device)
        self.seed = seed
        seq = banks.val.shape[1]
        g = torch.Generator().manual_seed(seed + 1)
        self.val_queries = [sample_queries(seq, config.query_tokens, g) for _ in range(self._val_batches())]
        self._train_inputs: LayerInputs | None = None
        self._bank: torch.Tensor | None = None  # _device_bank's copy of the training bank
        n, t, d = banks.train.shape
        full_bytes = 4 * n * t * (spec.num_heads * (spec.cache_width + t) + 2 * spec.cache_width + d)
        if full_bytes <= TRAIN_CACHE_BYTES:  # small problems: project the whole training bank once
            parts = []
            for i in range(0, n, config.batch_size):
                x = self.inputs(banks.train[i : i + config.batch_size], None)
                reference_output(x, w, spec)
                parts.append(x)
            self._train_inputs = LayerInputs.cat(parts)

    def _device_bank(self) -> torch.Tensor | None:
        """The training bank [N, T, D] on the accelerator (copied once per layer, for both paths) when it takes at
        most a quarter of the free device memory, so a step gathers its batch there; None on the CPU or when it does
        not fit (then each step copies its batch over, as before)."""
        if self._bank is None and self.device.type == "cuda" and self._train_inputs is None:
            nbytes = self.banks.train.numel() * self.banks.train.element_size()
            free, _ = torch.cuda.mem_get_info(self.device)
            if nbytes <= free // 4:
                self._bank = self.banks.train.to(self.device)
        return self._bank

    def _val_batches(self) -> int:
        return math.ceil(self.banks.val.shape[0] / self.config.batch_size)

    def inputs(self, hidden: torch.Tensor, qidx: torch.Tensor | None):
        cfg = self.config
        return layer_inputs(self.w, self.spec, hidden.to(self.device), self.cos, self.sin, qidx, cfg.sink, cfg.local)

    def loss(self, path: str, x, transform) -> torch.Tensor:
        if path == "content":
            return content_objective(x, self.w, self.spec, transform, self.fmt.content)
        return rope_objective(x, self.spec, transform, self.fmt.rope, self.config.rope_weighting)

    @torch.no_grad()
    def validate(self, path: str, transforms: dict[str, nn.Module | None]) -> dict[str, float]:
        """Validation NMSE (pooled over the bank) of every candidate, on fixed query subsets."""
        b = self.config.batch_size
        tot = {k: 0.0 for k in transforms}
        for n, i in enumerate(range(0, self.banks.val.shape[0], b)):
            x = self.inputs(self.banks.val[i : i + b], self.val_queries[n])
            for k, t in transforms.items():
                tot[k] += float(self.loss(path, x, t))
        nb = self._val_batches()
        return {k: v / nb for k, v in tot.items()}

    def train(self, path: str, transform: nn.Module, steps: int, lr: float, desc: str) -> list[float]:
        """AdamW (weight decay from the config), warmup + cosine; returns the training losses."""
        params = [p for p in transform.parameters() if p.requires_grad]
        if not params or steps == 0:
            return []
        cfg = self.config
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, cfg.warmup_frac))
        gen = torch.Generator().manual_seed(self.seed + (0 if path == "content" else 7919))
        n, seq = self.banks.train.shape[:2]
        # every step's sequences and query positions drawn up front, in the order the steps would draw them, and
        # moved to the device at once: a copy from pageable host memory per step would make the host wait for the
        # device every step (the same values as drawing them step by step: tests/calibrate/test_trainer.py)
        b = min(cfg.batch_size, n)
        draws = [(torch.randint(n, (b,), generator=gen), sample_queries(seq, cfg.query_tokens, gen))
                 for _ in range(steps)]  # fmt: skip
        idx_all = torch.stack([d[0] for d in draws]).to(self.device)  # [steps, batch]
        q_all = None if draws[0][1] is None else torch.stack([d[1] for d in draws]).to(self.device)  # [steps, Tq]
        bank = self._device_bank()  # the training bank on the device when it fits there, else None
        losses = []  # detached loss tensors: read back once at the end (a read per step would make the host wait
        bar = progress_over(range(steps), desc, cfg.progress)  # for the device every step); the bar every 25 steps
        for step in bar:
            qidx = None if q_all is None else q_all[step]
            if self._train_inputs is not None:
                x = self._train_inputs.select(idx_all[step], qidx)
            elif bank is not None:
                x = self.inputs(bank[idx_all[step]], qidx)
            else:
                x = self.inputs(self.banks.train[draws[step][0]], qidx)
            loss = self.loss(path, x, transform)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
            if hasattr(bar, "set_postfix") and (step % 25 == 0 or step == steps - 1):
                bar.set_postfix(nmse=f"{float(losses[-1]):.3e}")
        return torch.stack(losses).tolist()


def calibrate_attention(
    attn: nn.Module,
    spec: MLASpec,
    fmt: CacheFormat,
    banks: LayerBanks,
    config: CalibrationConfig,
    device: torch.device,
    layer: int,
) -> tuple[ContentTransform | None, RopeTransform | None, LayerReport]:
    """Build one attention module's transforms with ``config.method`` (not folded yet) and report them."""
    with matmul_precision(config.matmul_precision):
        return _calibrate_attention(attn, spec, fmt, banks, config, device, layer)


@contextmanager
def matmul_precision(name: str) -> Iterator[None]:
    """CUDA fp32 GEMMs in full fp32 (``fp32``) or on TF32 tensor cores (``tf32``) inside the block; the process's
    setting is restored on exit. A CPU computes fp32 either way."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):  # torch >= 2.9
        attr, value = "fp32_precision", "tf32" if name == "tf32" else "ieee"
    else:
        attr, value = "allow_tf32", name == "tf32"
    old = getattr(m, attr)
    setattr(m, attr, value)
    try:
        yield
    finally:
        setattr(m, attr, old)


def _calibrate_attention(attn, spec, fmt, banks, config, device, layer):
    t0 = time.time()
    w = extract_layer_weights(attn).to(device=device, dtype=torch.float32)
    prob = LayerProblem(w, spec, banks, fmt, config, device, seed=config.seed * 100003 + layer * 97)
    rep = LayerReport(layer=layer)
    pairs = spec.qk_rope_head_dim // 2
    content: ContentTransform | None = None
    rope: RopeTransform | None = None
    method = config.method
    if fmt.content is not None:
        ident = ContentTransform.identity(attn.kv_lora_rank, latent_norm_gain(attn))
        closed = _content_candidates(attn, prob, method, config, layer)
        content, rep.content = _path("content", prob, method, config, layer, ident, closed)
    if fmt.rope is not None:
        closed = _rope_candidates(prob, method, config, layer, pairs)
        rope, rep.rope = _path("rope", prob, method, config, layer, RopeTransform.identity(pairs), closed)
    rep.seconds = time.time() - t0
    return content, rope, rep


def _content_candidates(attn, prob: LayerProblem, method: str, config, layer: int) -> dict[str, nn.Module]:
    """The closed-form content transforms a method considers (the identity is always evaluated too)."""
    out: dict[str, nn.Module] = {}
    if method == "quarot" or (method == "quantmla" and config.content_init in ("best", "hadamard")):
        out["hadamard"] = baselines.quarot_content(attn, seed=config.seed + layer)
    if method == "smoothquant" or (method == "quantmla" and config.content_init == "best"):
        stats = baselines.latent_absmax(prob)
        for a in config.smoothquant_alphas:
            out[f"smooth(alpha={a:g})"] = baselines.smoothquant_content(attn, stats, a)
    return out


def _rope_candidates(prob: LayerProblem, method: str, config, layer: int, pairs: int) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {}
    if method == "quarot":
        out["pair_rotation"] = baselines.quarot_rope(pairs, seed=config.seed + layer)
    if method == "smoothquant" or (method == "quantmla" and config.rope_init == "best"):
        kmax, qmax = baselines.rope_absmax(prob)
        for a in config.smoothquant_alphas:
            out[f"smooth(alpha={a:g})"] = baselines.smoothquant_rope(kmax, qmax, a)
    return out


def _path(path: str, prob: LayerProblem, method: str, config, layer: int, identity: nn.Module, closed: dict):
    """Evaluate the closed-form candidates on validation; for QuantMLA learn from the best one; choose.

    RTN keeps the identity; the baselines keep their best closed-form candidate (for QuaRot the only one); QuantMLA
    keeps the learned transform unless (``select_on_val``) its start or the identity validates better.
    """
    dev = prob.device
    cands: dict[str, nn.Module] = {"identity": identity.to(dev), **{k: v.to(dev) for k, v in closed.items()}}
    val = prob.validate(path, cands)
    info: dict[str, Any] = {}
    if method == "rtn":
        name = "identity"
    elif method in ("quarot", "smoothquant"):
        name = min(closed, key=lambda k: val[k])
    else:
        init_name = min(cands, key=lambda k: val[k])
        start = cands[init_name]
        if path == "content":
            learned = start.learnable(rotation=True, scales=config.learn_content_scales).to(dev)
            steps, lr = config.steps_content, config.lr_content
        else:
            learned = start.learnable().to(dev)
            steps, lr = config.steps_rope, config.lr_rope
        losses = prob.train(path, learned, steps, lr, f"layer {layer} {path}")
        info.update(init=init_name, steps=len(losses))
        info.update(train_first=losses[0] if losses else None, train_last=losses[-1] if losses else None)
        cands["learned"] = learned
        val.update(prob.validate(path, {"learned": learned}))
        name = "learned"
        if config.select_on_val and val[init_name] < val["learned"]:
            name = init_name
    info.update(val=dict(val), val_identity=val["identity"], chosen=name, val_chosen=val[name])
    return cands[name].cpu(), info


# ---- the entry point -----------------------------------------------------------------------------------------


def calibrate_model(
    model: nn.Module,
    fmt: CacheFormat | str,
    calib_token_batches: torch.Tensor | Iterable[torch.Tensor],
    config: CalibrationConfig | None = None,
    *,
    query_moments: bool = False,
) -> CalibrationReport:
    """Calibrate every MLA attention layer of ``model`` for the cache format ``fmt`` and fold the transforms in
    place (the model's full-precision outputs are unchanged).

    ``query_moments``: also measure each folded layer's query second moment on its training inputs (the moments
    query-aware RoPE rounding is fitted to; :func:`~quantmla.calibrate.query_moments.layer_query_moment`) into
    ``report.query_moments`` -- the same inputs, hence the same bits, as ``calibrate-stream`` measures them on.

    ``calib_token_batches``: token ids, one tensor [N, T] or an iterable of [b, T] tensors; the first
    ``config.train_seqs`` sequences form the training bank and the next ``config.val_seqs`` the validation bank.
    Returns a :class:`CalibrationReport` (validation NMSE per layer and path for the identity and the chosen
    transform).
    """
    config = config or CalibrationConfig()
    spec = MLASpec.from_config(model.config)
    fmt = get_format(fmt).adapted(spec.kv_lora_rank, spec.qk_rope_head_dim)  # the groups the cache will use
    device = resolve_device(config.device)
    tokens = _token_bank(calib_token_batches, config)
    _check_policy_coverage(int(tokens.shape[1]), config)
    n_train = config.train_seqs
    t_start = time.time()
    report = CalibrationReport(
        config.method, fmt.name, config.to_dict(), n_train, config.val_seqs, int(tokens.shape[1])
    )
    was_training = model.training
    model.eval()
    for attn, x, cos, sin in iter_attention_inputs(model, tokens, config.batch_size, device, config.progress):
        banks = LayerBanks(x[:n_train], x[n_train:], cos, sin)
        content, rope, rep = calibrate_attention(attn, spec, fmt, banks, config, device, attn.layer_idx)
        fold_transforms(attn, spec, content, rope)
        report.layers.append(rep)
        if query_moments and fmt.rope is not None:
            report.query_moments[attn.layer_idx] = layer_query_moment(
                attn, spec, x[:n_train], cos, sin, sink=config.sink, local=config.local, batch_size=config.batch_size
            )
    model.train(was_training)
    report.seconds = time.time() - t_start
    return report


def _check_policy_coverage(seq: int, config: CalibrationConfig) -> None:
    """Refuse sequences on which the cache policy reads every key in full precision (objectives identically 0),
    and warn when few keys are quantized (the transforms then learn from a sliver of the data)."""
    if config.method not in ("quantmla", "smoothquant") or config.sink + config.local == 0:
        return
    if seq <= config.sink + config.local:
        raise ValueError(
            f"calibration sequences of {seq} tokens with sink {config.sink} + local {config.local}: every key is read "
            f"in full precision, so there is nothing to calibrate; use seq_len > {config.sink + config.local} "
            f"(>= {4 * config.local} recommended) or a smaller local window"
        )
    if seq < 4 * config.local:
        warnings.warn(
            f"calibration sequences of {seq} tokens are short for local window {config.local}: few keys are read "
            f"quantized; seq_len >= {4 * config.local} is recommended",
            stacklevel=3,
        )


__all__ = [
    "CalibrationReport",
    "LayerReport",
    "calibrate_attention",
    "calibrate_model",
    "iter_attention_inputs",
    "resolve_device",
    "warmup_cosine",
]
