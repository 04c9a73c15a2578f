"""The query second moments that query-aware RoPE rounding (:mod:`quantmla.quant.rounding`) is fitted to.

Per attention layer, ``H = sum over (query, key) pairs read from the packed cache of p(query, key) q q^T``: the
rotated RoPE queries ``q`` [Dr] of every head, weighted by the full-precision attention probability they give the
key (an error on a key nobody attends costs nothing), over calibration text run through the model *with its
transforms folded* (so ``H`` is in the coordinates the cache stores). The first ``sink`` keys and each query's last
``local`` keys are left out, as the runtime keeps them in BF16. Stored normalized to unit mean diagonal (fp16 in a
transforms file: ``layers.i.rope.query_moment``).
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.calibrate.blocks import iter_attention_inputs
from quantmla.calibrate.config import ROPE_ROTATIONS, ROTATION_SEED
from quantmla.calibrate.delta import ROUNDING_FILE, ROUNDING_KIND, ROUNDING_VERSION, load_tagged, save_tagged
from quantmla.calibrate.objectives import attention_probs, layer_inputs
from quantmla.mla.spec import MLASpec
from quantmla.mla.weights import extract_layer_weights, iter_mla_attention
from quantmla.quant.rounding import ROPE_ROUNDING_ATTR, RopeRounding, fit_rope_rounding


@torch.no_grad()
def layer_query_moment(
    attn: nn.Module,
    spec: MLASpec,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    sink: int = 4,
    local: int = 128,
    query_stride: int = 4,
    batch_size: int = 4,
) -> torch.Tensor:
    """H [Dr, Dr] fp32 (unit mean diagonal, on the CPU) of one attention module on its inputs ``hidden`` [N, T, D]
    (``cos`` / ``sin`` [1, T, Dr/2]); every ``query_stride``-th position from ``local`` on is a query (keys before
    ``local`` are all in the BF16 window). The module as it is now: fold the transforms first."""
    t = hidden.shape[1]
    if hidden.dim() != 3 or t <= local + 1:
        raise ValueError(f"inputs must be [N, T, D] with T > local + 1 = {local + 1} (queries that read packed "
                         f"keys), got {tuple(hidden.shape)}")  # fmt: skip
    w = extract_layer_weights(attn)
    dev = w.o_proj.device
    qidx = torch.arange(local, t, query_stride)
    h = torch.zeros(spec.qk_rope_head_dim, spec.qk_rope_head_dim, dtype=torch.float64, device=dev)
    for j in range(0, hidden.shape[0], batch_size):
        x = layer_inputs(w, spec, hidden[j : j + batch_size].to(dev), cos.to(dev), sin.to(dev), qidx, sink, local)
        p = attention_probs(x, spec)  # [B, H, Tq, S]
        weight = (p * x.quant_mask.to(p.dtype)).sum(-1)  # [B, H, Tq]: the probability it gives packed keys
        h += torch.einsum("bht,bhtr,bhtq->rq", weight, x.q_pe, x.q_pe).double()
    mean = h.diagonal().mean()
    return (h / mean if mean > 0 else h).float().cpu()


def query_moments(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    sink: int = 4,
    local: int = 128,
    query_stride: int = 4,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> dict[int, torch.Tensor]:
    """{cache layer index: :func:`layer_query_moment`} of ``model`` on ``tokens`` [N, T], block by block."""
    if tokens.dim() != 2 or tokens.shape[1] <= local + 1:
        raise ValueError(f"tokens must be [N, T] with T > local + 1 = {local + 1} (queries that read packed keys), "
                         f"got {tuple(tokens.shape)}")  # fmt: skip
    spec = MLASpec.from_config(model.config)
    index = {id(a): i for i, a in iter_mla_attention(model)}
    out = {}
    for attn, hidden, cos, sin in iter_attention_inputs(model, tokens, batch_size, torch.device(device), progress):
        out[index[id(attn)]] = layer_query_moment(attn, spec, hidden, cos, sin, sink=sink, local=local,
                                                  query_stride=query_stride, batch_size=batch_size)  # fmt: skip
    return out


def hadamard_rotation(d: int, seed: int = 0) -> torch.Tensor:
    """A post-RoPE rotation for a ``d``-channel RoPE key (:class:`~quantmla.quant.rounding.RopeRounding`'s
    ``rotation``): the random-sign Hadamard matrix of :func:`quantmla.calibrate.transforms.hadamard` (a seeded
    random orthogonal matrix where ``d`` is not a power of two), fp32 [d, d]. On SmolLM2-MLA at C4R4 it takes the
    query-aware rounding's KL down by ~46% (docs/calibrate.md, "A rotation after RoPE")."""
    from quantmla.calibrate.transforms import hadamard

    return hadamard(d, seed=seed).to(torch.float32)


def rope_rotations(moments: dict, kind: str = "hadamard") -> tuple[dict | None, dict]:
    """({layer: post-RoPE rotation} or None, the record of the rounding for ``quantmla.json``) for the layers of
    ``moments``: ``kind`` hadamard = :func:`hadamard_rotation` of seed :data:`ROTATION_SEED` in every layer, none =
    no rotation. Raises ``ValueError`` on another kind (also for empty ``moments``: check a kind before work)."""
    if kind not in ROPE_ROTATIONS:
        raise ValueError(f"--rope-rotation {kind!r}: choose one of {', '.join(ROPE_ROTATIONS)}")
    record = {"method": "query-aware", "rotation": None}
    if kind == "none" or not moments:
        return None, record
    record["rotation"] = {"kind": "hadamard", "seed": ROTATION_SEED, "where": "after RoPE, at cache write and read"}
    return {i: hadamard_rotation(m.shape[0], seed=ROTATION_SEED) for i, m in moments.items()}, record


def attach_rope_rounding(model: nn.Module, moments: dict[int, torch.Tensor],
                         rotations: dict[int, torch.Tensor] | None = None) -> int:  # fmt: skip
    """Fit a plan to each layer's moment and attach it to the attention module (where
    :func:`quantmla.cache.hf.rope_rounding_of` finds it); returns the number of layers given one. ``rotations``:
    {layer: post-RoPE rotation [Dr, Dr]} for some or all of those layers (their plans round the rotated key)."""
    attns = dict(iter_mla_attention(model))
    rotations = dict(rotations or {})
    for i in (*moments, *rotations):
        if i not in attns:
            raise ValueError(f"a query moment or rotation for layer {i}; the model has {len(attns)} attention layers")
    for i in rotations:
        if i not in moments:
            raise ValueError(f"a post-RoPE rotation for layer {i} without its query moment (the plan needs both)")
    for i, m in moments.items():
        setattr(attns[i], ROPE_ROUNDING_ATTR, fit_rope_rounding(m, rotation=rotations.get(i)))
    return len(moments)


MOMENT_KEY = "layers.{}.rope.query_moment"  # a layer's moment in a rounding file and in a transforms file
ROTATION_KEY = "layers.{}.rope.post_rotation"  # a layer's post-RoPE rotation (fp32 [Dr, Dr]), where it has one


def rounding_file_tensors(moments: dict[int, torch.Tensor], rotations: dict[int, torch.Tensor] | None = None
                          ) -> dict[str, torch.Tensor]:  # fmt: skip
    """{``MOMENT_KEY`` of layer i: its moment in fp16} (+ {``ROTATION_KEY``: its rotation in fp32}): how both kinds
    of file store them."""
    out = {MOMENT_KEY.format(i): m.detach().to(torch.float16).cpu().contiguous() for i, m in moments.items()}
    for i, r in (rotations or {}).items():
        out[ROTATION_KEY.format(i)] = r.detach().to(torch.float32).cpu().contiguous()
    return out


def moments_in(tensors: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """{layer: fp32 moment} of the ``MOMENT_KEY`` entries of a file's tensors."""
    return {int(k.split(".")[1]): t.float() for k, t in tensors.items() if k.endswith(".rope.query_moment")}


def rotations_in(tensors: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """{layer: fp32 post-RoPE rotation} of the ``ROTATION_KEY`` entries of a file's tensors ({} in files without)."""
    return {int(k.split(".")[1]): t.float() for k, t in tensors.items() if k.endswith(".rope.post_rotation")}


def save_rounding_file(directory, moments: dict[int, torch.Tensor], meta: dict | None = None,
                       rotations: dict[int, torch.Tensor] | None = None) -> None:  # fmt: skip
    """Write :data:`ROUNDING_FILE` into ``directory`` (temp file + rename). The moments are in the channel order
    of the model's cache (``MLASpec.rope_cache_pairing``), as :func:`query_moments` measures them; ``rotations``
    (optional): post-RoPE rotations in the same order."""
    import os

    save_tagged(os.path.join(str(directory), ROUNDING_FILE), rounding_file_tensors(moments, rotations),
                dict(meta or {}), kind=ROUNDING_KIND, version=ROUNDING_VERSION, force=False)  # fmt: skip


def _saved(model_dir) -> dict[str, torch.Tensor]:
    import os

    path = os.path.join(str(model_dir), ROUNDING_FILE)
    if not os.path.isfile(path):
        return {}
    tensors, _ = load_tagged(path, kind=ROUNDING_KIND, version=ROUNDING_VERSION, what="rope-rounding file")
    return tensors


def saved_moments(model_dir) -> dict[int, torch.Tensor]:
    """{cache layer: fp32 moment} stored beside a checkpoint (:data:`ROUNDING_FILE`); {} without one."""
    return moments_in(_saved(model_dir))


def saved_rounding_plans(model_dir) -> dict[int, RopeRounding]:
    """{cache layer: plan} fitted to the moments (and post-RoPE rotations, where stored) beside a checkpoint, in the
    model's cache channel order: what the serving backend gives its layers (it never holds the transformers
    modules)."""
    tensors = _saved(model_dir)
    rotations = rotations_in(tensors)
    return {i: fit_rope_rounding(m, rotation=rotations.get(i)) for i, m in sorted(moments_in(tensors).items())}


def load_saved_rope_rounding(model: nn.Module, model_dir) -> int:
    """Attach the rounding stored beside a fused checkpoint (:data:`ROUNDING_FILE`), if there is one; returns the
    number of layers given a plan (0: none stored)."""
    tensors = _saved(model_dir)
    moments = moments_in(tensors)
    return attach_rope_rounding(model, moments, rotations_in(tensors)) if moments else 0


__all__ = ["MOMENT_KEY", "ROTATION_KEY", "ROUNDING_FILE", "attach_rope_rounding", "hadamard_rotation", "rope_rotations",
           "layer_query_moment", "load_saved_rope_rounding", "moments_in", "query_moments", "rotations_in",
           "rounding_file_tensors", "save_rounding_file", "saved_moments", "saved_rounding_plans"]
