"""The healing delta of variant b: a low-rank update of the latent path's projections, stored and merged.

A delta (from :func:`quantmla.models.heal.heal` with ``rank > 0``) holds, for every projection of the latent path
(``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj`` of each attention layer), BF16 factors ``<name>.lora_A`` [r, in]
and ``<name>.lora_B`` [out, r], and the latent norm gains ``<norm>.weight`` (fp32). :func:`merge_heal_delta` folds
it into a fresh variant-b conversion (``W += B @ A`` in fp32), so the healed model ships as ~10 MB. This module
needs neither the conversion nor the training code: both use it.
"""

from __future__ import annotations

import json
import os

import torch
from torch.nn.utils import parametrize

PROJECTIONS = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # the linear maps of the latent path
TRAINABLE = (*PROJECTIONS, "kv_a_layernorm")  # ... and the latent norm: what healing trains


def _latent_path_modules(model):
    """(name, module) of every projection of the latent path, attention layer by layer."""
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS and ".self_attn." in f".{name}" and hasattr(mod, "weight"):
            yield name, mod


def merge_heal_delta(model, delta: dict[str, torch.Tensor]) -> None:
    """Fold ``delta`` (from :func:`heal_delta`) into ``model``'s weights in place: remove the parametrizations if
    any, then ``W += B @ A`` in fp32 with the stored (BF16) factors, and set the latent norm gains. Raises
    ``KeyError`` naming what the model and the delta disagree on."""
    for _, mod in list(_latent_path_modules(model)):
        if parametrize.is_parametrized(mod, "weight"):
            parametrize.remove_parametrizations(mod, "weight", leave_parametrized=False)
    mods = dict(model.named_modules())
    params = dict(model.named_parameters())
    used = set()
    for name, _ in list(_latent_path_modules(model)):
        ka, kb = f"{name}.lora_A", f"{name}.lora_B"
        if ka not in delta or kb not in delta:
            raise KeyError(f"the healing delta has no factors for {name}: it was made for another model")
        w = mods[name].weight
        a, b = delta[ka].float(), delta[kb].float()
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise KeyError(f"{name}: delta {tuple(b.shape)} @ {tuple(a.shape)} does not match weight {tuple(w.shape)}")
        with torch.no_grad():
            w.copy_((w.float() + b.to(w.device) @ a.to(w.device)).to(w.dtype))
        used |= {ka, kb}
    for k, v in delta.items():
        if k in used:
            continue
        if k not in params:
            raise KeyError(f"the healing delta has {k}, which the model lacks: it was made for another model")
        with torch.no_grad():
            params[k].copy_(v.to(params[k].dtype))


def save_heal_delta(delta: dict[str, torch.Tensor], path: str, meta: dict, *, force: bool = False) -> str:
    """Write a delta (:func:`quantmla.models.heal.heal_delta`) to ``path`` (safetensors; ``meta`` stored as JSON
    strings) via a temp file. Without ``force`` the final step is a hard link, which fails if ``path`` exists by
    then (an existing file is never replaced); with ``force`` it is an atomic rename over it."""
    from safetensors.torch import save_file

    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(delta, tmp, metadata={k: json.dumps(v) for k, v in meta.items()})
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # create-exclusive: EEXIST if another run wrote path meanwhile
            except FileExistsError:
                raise FileExistsError(f"{path} appeared while this job ran; it was left as it is") from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
    return path


def load_heal_delta(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a delta file written by :func:`save_heal_delta`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        return {k: f.get_tensor(k) for k in f.keys()}, meta
