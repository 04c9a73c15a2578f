"""Calibrated transforms as a small file, and the ones that ship with quantmla, loaded by name.

A transforms file (safetensors) holds, per attention layer ``i``, the learned content transform's factors
``layers.i.content.u`` [Dc], ``.q`` [Dc, Dc], ``.v`` [Dc] (``T = diag(u) Q diag(v)``) and the RoPE transform's
``layers.i.rope.log_s`` / ``.phi`` [Dr/2], in fp32 (a few MB for the embedded model), optionally the RoPE queries'
second moment ``layers.i.rope.query_moment`` [Dr, Dr] (fp16, :mod:`quantmla.calibrate.query_moments`: folding
attaches the layer's query-aware rounding plan, which every cache built for the model then uses) and beside it, where
calibration chose one, a post-RoPE rotation of the key ``layers.i.rope.post_rotation`` [Dr, Dr] (fp32, orthogonal;
the shipped files carry a Hadamard, recorded in ``rope_rounding.rotation``), plus metadata (JSON
strings): ``format`` = ``quantmla-transforms``, ``version``, ``model`` (the built-in name it was calibrated on),
``base_key`` (that model's conversion key: a transforms file is never applied to another base), ``cache_format``,
``method``, ``calibration`` (the recipe), ``label`` (what budget / machine produced it) and ``eval``: evaluation
numbers measured on a small slice with the loaded transforms, which ``tests/calibrate/test_shipped.py``
reproduces.

Folding the loaded transforms (:func:`apply_transforms`) is the same exact algebra as after calibration: ``Q`` is
re-orthogonalized in float64 (the nearest orthogonal matrix to the stored fp32 one) and, with a latent RMSNorm,
``u`` is pinned to ``1 / g`` of the model's current gain, so full precision is unchanged to float64 rounding.

Shipped files live in ``quantmla/models/data/<model>-quantmla-<format>.safetensors`` (package data, like the
healing delta); :func:`apply_shipped` folds one into a loaded model by name (``quantmla eval --quantmla c4r4``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

TRANSFORMS_FORMAT = "quantmla-transforms"
TRANSFORMS_VERSION = 1
DATA_DIR = Path(__file__).resolve().parents[1] / "models" / "data"


def transforms_tensors(layer: int, content, rope, query_moment: torch.Tensor | None = None,
                       post_rotation: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The file's tensors for one attention layer's transforms (None = identity, not stored) and, optionally, its
    RoPE queries' second moment (stored fp16, for query-aware rounding) and a post-RoPE rotation of the key (fp32,
    :class:`~quantmla.quant.rounding.RopeRounding`; only beside a moment)."""
    out = {}
    if post_rotation is not None and query_moment is None:
        raise ValueError("a post-RoPE rotation is stored with the query moment its rounding plan is fitted to")
    if query_moment is not None:
        from quantmla.calibrate.query_moments import rounding_file_tensors

        rot = None if post_rotation is None else {layer: post_rotation}
        out.update(rounding_file_tensors({layer: query_moment}, rot))
    if content is not None:
        u, q, v = (x.detach().to(torch.float32).cpu().contiguous() for x in content.factors(torch.float64))
        out.update({f"layers.{layer}.content.u": u, f"layers.{layer}.content.q": q, f"layers.{layer}.content.v": v})
    if rope is not None:
        out[f"layers.{layer}.rope.log_s"] = rope.log_s.detach().float().cpu().contiguous()
        out[f"layers.{layer}.rope.phi"] = rope.phi.detach().float().cpu().contiguous()
    return out


def save_transforms(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict, *, force: bool = False):
    """Write a transforms file (temp file + rename); refuses to overwrite without ``force``."""
    from quantmla.calibrate.delta import save_tagged

    return save_tagged(path, tensors, meta, kind=TRANSFORMS_FORMAT, version=TRANSFORMS_VERSION, force=force)


def load_transforms(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    from quantmla.calibrate.delta import load_tagged

    return load_tagged(path, kind=TRANSFORMS_FORMAT, version=TRANSFORMS_VERSION, what="transforms file")


def _nearest_orthogonal(q: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(q.double())
    return u @ vh


def layer_transforms(attn: nn.Module, spec, tensors: dict[str, torch.Tensor], i: int):
    """(content, rope) transform objects of attention layer ``i`` from a file's tensors (None where the file holds
    none), checked against ``attn`` (latent width, latent-norm gain, RoPE pairs): ``ValueError`` names a mismatch."""
    from quantmla.calibrate.fuse import latent_norm_gain
    from quantmla.calibrate.transforms import ContentTransform, RopeTransform

    content, rope = None, None
    if f"layers.{i}.content.q" in tensors:
        u, q, v = (tensors[f"layers.{i}.content.{n}"].double() for n in "uqv")
        if q.shape != (attn.kv_lora_rank, attn.kv_lora_rank):
            raise ValueError(f"layer {i}: content transform {tuple(q.shape)} for a {attn.kv_lora_rank}-dim latent")
        g = latent_norm_gain(attn)
        if g is not None:
            inv = 1.0 / g.double().cpu()
            if not torch.allclose(u, inv, rtol=1e-4, atol=0):
                raise ValueError(f"layer {i}: the content transform was made for another latent-norm gain")
            u = inv
        content = ContentTransform(u, _nearest_orthogonal(q), v, learn_rotation=False, learn_u=False,
                                   learn_v=False)  # fmt: skip
    if f"layers.{i}.rope.log_s" in tensors:
        log_s = tensors[f"layers.{i}.rope.log_s"]
        if log_s.shape != (spec.qk_rope_head_dim // 2,):
            raise ValueError(f"layer {i}: {log_s.shape[0]} RoPE pairs, key is {spec.qk_rope_head_dim}-dim")
        rope = RopeTransform(log_s.shape[0], log_s, tensors[f"layers.{i}.rope.phi"])
    return content, rope


@torch.no_grad()
def apply_transforms(model: nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Fold the transforms of a file into ``model`` in place; returns the number of layers changed. Raises
    ``ValueError`` naming the mismatch when the file was made for another model (before changing anything)."""
    from quantmla.calibrate.fuse import fold_transforms
    from quantmla.mla.spec import MLASpec
    from quantmla.mla.weights import iter_mla_attention

    spec = MLASpec.from_config(model.config)
    attns = dict(iter_mla_attention(model))
    layers = sorted({int(k.split(".")[1]) for k in tensors})
    from quantmla.calibrate.query_moments import attach_rope_rounding, moments_in, rotations_in

    moments = moments_in(tensors)  # {layer: query moment}: the layers' query-aware RoPE rounding, where stored
    rotations = rotations_in(tensors)  # {layer: post-RoPE rotation}, where stored
    plan = []
    for i in layers:
        if i not in attns:
            raise ValueError(f"the transforms have layer {i}, the model has {len(attns)} attention layers")
        if i in moments and moments[i].shape != (spec.qk_rope_head_dim,) * 2:
            raise ValueError(f"layer {i}: a {tuple(moments[i].shape)} query moment for a "
                             f"{spec.qk_rope_head_dim}-dim RoPE key")  # fmt: skip
        plan.append((attns[i], *layer_transforms(attns[i], spec, tensors, i)))
    for attn, content, rope in plan:
        fold_transforms(attn, spec, content, rope)
    if moments:
        attach_rope_rounding(model, moments, rotations)
    return len(plan)


# ---- shipped files, by name ----------------------------------------------------------------------------------


def shipped_path(model_name: str, fmt: str) -> Path:
    from quantmla.models.names import canonical_name

    key = canonical_name(model_name) or model_name
    return DATA_DIR / f"{key}-quantmla-{fmt.lower()}.safetensors"


def shipped_available() -> list[tuple[str, str]]:
    """(model name, format) of every transforms file that ships with this install."""
    out = []
    for p in sorted(DATA_DIR.glob("*-quantmla-*.safetensors")):
        model, _, fmt = p.name[: -len(".safetensors")].rpartition("-quantmla-")
        out.append((model, fmt))
    return out


def base_key_of(model_name: str) -> str | None:
    """The conversion key of a built-in model (what a shipped file's ``base_key`` must equal); None for folders."""
    from quantmla.models.names import canonical_name

    key = canonical_name(model_name)
    if key is None:
        return None
    from quantmla.models.convert import ConvertConfig, conversion_key, healed_model_dir

    if key == "smollm2-mla":
        return conversion_key("smollm2", ConvertConfig(variant="a"))
    if key == "smollm2-mla-b":
        return conversion_key("smollm2", ConvertConfig(variant="b"))
    if key == "smollm2-mla-b-healed":
        return os.path.basename(healed_model_dir())
    return None


def load_shipped(model_name: str, fmt: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The shipped transforms for ``model_name`` (a built-in name) and cache format ``fmt``; a clear error listing
    what ships when there is none."""
    p = shipped_path(model_name, fmt)
    if not p.is_file():
        have = ", ".join(f"{m} {f}" for m, f in shipped_available()) or "none"
        raise FileNotFoundError(f"no shipped QuantMLA transforms for --model {model_name} at {fmt}; shipped: {have}")
    return load_transforms(p)


def apply_shipped(model: nn.Module, model_name: str, fmt: str) -> dict:
    """Fold the shipped transforms for (``model_name``, ``fmt``) into ``model`` in place; returns their metadata.
    Refuses a file whose base key is not the key of the model it is applied to."""
    tensors, meta = load_shipped(model_name, fmt)
    want = base_key_of(model_name)
    if want is not None and meta.get("base_key") not in (None, want):
        raise ValueError(
            f"the shipped {fmt} transforms were calibrated on {meta.get('base_key')!r}, this install builds {want!r} "
            "(another converter version or source): recalibrate with `quantmla calibrate`"
        )
    apply_transforms(model, tensors)
    return meta


def shipped_summary(model_name: str = "smollm2-mla", fmt: str = "c4r4") -> dict | None:
    """The stored evaluation of the shipped transforms (None when none ship): for ``quantmla run`` to show the
    full-budget result beside its short live calibration. Keys: ``label``, ``calibration``, ``eval``."""
    try:
        _, meta = load_shipped(model_name, fmt)
    except FileNotFoundError:
        return None
    return {k: meta.get(k) for k in ("label", "method", "cache_format", "calibration", "eval", "base_key")}


def recipe_text(cal: dict | None) -> str:
    """A calibration recipe in a few words, against the paper's (Table 7) budget: e.g. "24+24 steps per layer on 8 x
    512 tokens; reduced budget (paper: 300+300 on 128 x 2048)"."""
    from quantmla.calibrate.config import CalibrationConfig, recorded_rope_weighting

    if not cal:
        return "recipe not recorded"
    keys = ("steps_content", "steps_rope", "train_seqs", "seq_len")
    if any(k not in cal for k in keys):
        return "recipe incomplete"
    paper = CalibrationConfig()
    mine = (f"{cal['steps_content']}+{cal['steps_rope']} steps per layer on {cal['train_seqs']} x {cal['seq_len']} "
            "tokens")
    objective = "; attention-weighted RoPE objective" if recorded_rope_weighting(cal) != "uniform" else ""
    if all(cal[k] >= getattr(paper, k) for k in keys):
        return mine + " (the paper's budget)" + objective
    return (f"{mine}; reduced budget (paper: {paper.steps_content}+{paper.steps_rope} on {paper.train_seqs} x "
            f"{paper.seq_len})" + objective)  # fmt: skip


def format_shipped_summary(model_name: str = "smollm2-mla", fmt: str = "c4r4") -> str | None:
    """One line for ``quantmla run``: what the shipped transforms achieve (from their stored evaluation)."""
    s = shipped_summary(model_name, fmt)
    if s is None or not s.get("eval"):
        return None
    e = s["eval"]
    parts = [f"shipped QuantMLA {fmt.upper()} transforms ({s.get('label', 'unlabelled')})"]
    if e.get("kl_removed_vs_rtn") is not None:
        parts.append(f"remove {100 * e['kl_removed_vs_rtn']:.0f}% of RTN's KL")
    if e.get("ppl_gap_closed_vs_rtn") is not None:
        parts.append(f"close {100 * e['ppl_gap_closed_vs_rtn']:.0f}% of its perplexity gap")
    if "tokens" in e:
        parts.append(f"on {e['tokens']} held-out tokens")
    return parts[0] + (": " + ", ".join(parts[1:]) if len(parts) > 1 else "")


__all__ = [
    "apply_shipped",
    "apply_transforms",
    "format_shipped_summary",
    "layer_transforms",
    "load_shipped",
    "load_transforms",
    "recipe_text",
    "save_transforms",
    "shipped_available",
    "shipped_path",
    "shipped_summary",
    "transforms_tensors",
]
