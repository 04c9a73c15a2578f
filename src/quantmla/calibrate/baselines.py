"""The paper's baselines, adapted to MLA inside the same fold-exact transform families.

* **RTN** -- identity transforms: round-to-nearest group quantization of the latent and the RoPE key as they are.
* **SmoothQuant-MLA** -- SmoothQuant moves outlier magnitude from activations into the weights that consume them
  with a per-channel scale ``s_j = max|x_j|^alpha / max|W_j|^(1-alpha)``. Here the "activation" is the cached
  latent and the consumer is ``kv_b_proj`` (W_UK and W_UV both read channel j): the cache stores ``c / s`` and
  ``s`` is folded into ``kv_b_proj``'s columns. With a latent norm this is ``T = diag(1/s)``, i.e. the new gain
  ``g / s`` (a member of ``diag(g)^-1 Q diag(g')`` with Q = I). On the RoPE path a per-channel scale commutes with
  RoPE only if both members of a frequency pair share it, so the smoothing is per pair:
  ``s_p = max|k_p|^alpha / max|q_p|^(1-alpha)`` with ``|.|`` the pair's 2-norm (rotation invariant, so the
  statistics are the same before and after RoPE); the query gets ``s_p`` back. ``alpha`` is picked per layer
  and path on the validation bank from ``CalibrationConfig.smoothquant_alphas``.
* **QuaRot-MLA** -- QuaRot folds norm gains into the next linear layer and rotates with a randomized Hadamard
  matrix to spread outliers over all channels. Content path: ``T = diag(g)^-1 H`` (gain folded into
  ``kv_b_proj``, the norm's new gain is 1) or ``T = H`` without a latent norm. A Hadamard rotation of the RoPE
  key does not commute with RoPE; the closest rotations that do are per-pair rotations, so the RoPE path gets a
  seeded random angle per pair (unit scale). Such a rotation leaves each pair's norm as it is, so it cannot spread
  energy across pairs -- which is the honest limit of rotation methods on the RoPE path.
"""

from __future__ import annotations

from typing import Any

import torch

from quantmla.calibrate.fuse import latent_norm_gain
from quantmla.calibrate.transforms import ContentTransform, RopeTransform, hadamard, split_pairs
from quantmla.mla.reference import project_latent, project_queries

_EPS = 1e-5


def rtn_content(attn) -> ContentTransform:
    return ContentTransform.identity(attn.kv_lora_rank, latent_norm_gain(attn))


def quarot_content(attn, seed: int = 0) -> ContentTransform:
    """``T = diag(g)^-1 H`` (with a latent norm of gain g) or ``T = H``; H a randomized Hadamard matrix."""
    return ContentTransform.rotation(hadamard(attn.kv_lora_rank, seed=seed), latent_norm_gain(attn))


def quarot_rope(num_pairs: int, seed: int = 0) -> RopeTransform:
    return RopeTransform.random_rotation(num_pairs, seed=seed)


@torch.no_grad()
def latent_absmax(prob: Any) -> dict[str, torch.Tensor]:
    """Per-channel max |c_j| over the training bank and max |W_j| over ``kv_b_proj``'s column j (fp64, CPU)."""
    cmax = None
    b = prob.config.batch_size
    for i in range(0, prob.banks.train.shape[0], b):
        h = prob.banks.train[i : i + b].to(prob.device).to(prob.w.o_proj.dtype)
        c, _ = project_latent(prob.w, prob.spec, h)  # [B, T, Dc]
        m = c.abs().amax(dim=(0, 1)).double().cpu()
        cmax = m if cmax is None else torch.maximum(cmax, m)
    wmax = prob.w.kv_b_proj.abs().amax(dim=0).double().cpu()  # [Dc]
    return {"c": cmax, "w": wmax}


def smoothquant_content(attn, stats: dict[str, torch.Tensor], alpha: float) -> ContentTransform:
    s = stats["c"].clamp_min(_EPS) ** alpha / stats["w"].clamp_min(_EPS) ** (1 - alpha)  # [Dc]
    return ContentTransform.diagonal(1.0 / s, latent_norm_gain(attn))


@torch.no_grad()
def rope_absmax(prob: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair max 2-norm of the RoPE key and of the query's RoPE part (all heads), over the training bank."""
    pairing = prob.spec.rope_pairing  # unrotated tensors: pre-RoPE layout
    kmax = qmax = None
    b = prob.config.batch_size
    for i in range(0, prob.banks.train.shape[0], b):
        h = prob.banks.train[i : i + b].to(prob.device).to(prob.w.o_proj.dtype)
        _, k = project_latent(prob.w, prob.spec, h)  # [B, T, Dr]
        _, q = project_queries(prob.w, prob.spec, h)  # [B, H, T, Dr]
        k1, k2 = split_pairs(k.double(), pairing)
        q1, q2 = split_pairs(q.double(), pairing)
        km = (k1.square() + k2.square()).sqrt().flatten(0, -2).amax(0).cpu()  # [Dr/2]
        qm = (q1.square() + q2.square()).sqrt().flatten(0, -2).amax(0).cpu()
        kmax = km if kmax is None else torch.maximum(kmax, km)
        qmax = qm if qmax is None else torch.maximum(qmax, qm)
    return kmax, qmax


def smoothquant_rope(kmax: torch.Tensor, qmax: torch.Tensor, alpha: float, spec: Any = None) -> RopeTransform:
    s = kmax.clamp_min(_EPS) ** alpha / qmax.clamp_min(_EPS) ** (1 - alpha)  # [Dr/2]
    return RopeTransform.scales(1.0 / s)
