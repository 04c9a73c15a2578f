"""Per-layer bit allocation with QuantMLA's calibrated transforms folded in, and hand-made per-layer plans.

:mod:`.allocate` measures every (layer, path, bits) distortion on whatever model it is given. With QuantMLA the
cache stores the *transformed* latent ``c T`` and RoPE key ``k_pe z``, so the sensitivities that matter are those
of the model with the transforms folded into its weights, and a plan must be served by that same folded model.

**Why one transforms file serves every layer's format.** A transforms file (:mod:`quantmla.calibrate.shipped`)
holds per layer only the content factors ``u, Q, v`` (``T = diag(u) Q diag(v)``) and the RoPE pair factors
``log_s, phi`` (``z = s e^{i phi}``); folding them (:func:`quantmla.calibrate.fuse.fold_transforms`) rewrites the
projections so that ``kv_b_proj`` reads ``c T T^-1`` and the query's RoPE columns get ``z / |z|^2``: full precision
is unchanged to float rounding whatever the cache does afterwards. Nothing in the file depends on the bit width
(no clipping ratios, no scales: the cache format quantizes the folded model's latents on its own). So the C4R4
transforms may be served at C4R8, C2R4 or BF16 in any layer: the result is a valid model, merely not one whose
transforms were trained for that width. The allocator sees exactly that, because the sensitivities are measured on
the folded model at every width. (The content and RoPE transforms of different layers touch disjoint weights, so a
per-layer choice of files would fold just as exactly; it is not offered here, as only the C4R4 file is calibrated
at the paper's budget.)

:class:`TransformSource` names the transforms (``none``, ``shipped:FMT`` for the file that ships with quantmla for
the model, or a path to a transforms file); :func:`fold_source` returns a folded copy. :func:`plan_from_formats`
turns a hand-made per-layer format list (e.g. ``mix:c4r8@7,17,18,20,23:c4r4``, :func:`mix_formats`) into a
:class:`~.allocate.Plan` with the error model's predictions, so it is scored beside the allocator's plan at the
same bytes.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

MIX_RE = re.compile(r"^mix:(\w+)@([\d,]+):(\w+)$")  # mix:FMT@LAYERS:OTHER -- FMT in those layers, OTHER elsewhere


@dataclass(frozen=True)
class TransformSource:
    """Which calibrated transforms to fold before measuring / serving a plan: ``kind`` is ``none`` (RTN: the model
    as it is), ``shipped`` (the file that ships for the model at cache format ``fmt``) or ``file`` (``path``)."""

    kind: str = "none"
    fmt: str | None = None
    path: str | None = None

    def __post_init__(self):
        if self.kind not in ("none", "shipped", "file"):
            raise ValueError(f"transform source kind {self.kind!r}; expected none, shipped or file")
        if self.kind == "shipped" and not self.fmt:
            raise ValueError("shipped transforms need a cache format, e.g. shipped:c4r4")
        if self.kind == "file" and not self.path:
            raise ValueError("a transforms file source needs a path")

    @classmethod
    def parse(cls, text: str) -> TransformSource:
        """``none`` / ``rtn``, ``shipped:FMT`` (e.g. ``shipped:c4r4``), or a path to a transforms ``.safetensors``
        file (which must exist)."""
        t = (text or "").strip()
        if t.lower() in ("", "none", "rtn"):
            return cls()
        if t.lower().startswith("shipped:"):
            fmt = t.split(":", 1)[1].strip().lower()
            from quantmla.quant.formats import get_format

            get_format(fmt)  # a clear error for an unknown format name
            return cls("shipped", fmt=fmt)
        if t.lower() == "shipped":
            raise ValueError("name the shipped file's format: shipped:c4r4 (or shipped:c2r4)")
        if not os.path.isfile(t):
            raise ValueError(f"transforms {text!r}: expected none, shipped:FMT or an existing transforms file")
        return cls("file", path=t)

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none (RTN)"
        return f"shipped:{self.fmt}" if self.kind == "shipped" else os.path.basename(self.path)

    def load(self, model_name: str | None) -> tuple[dict, dict]:
        """(tensors, metadata) of the file; ``({}, {})`` for ``none``."""
        from quantmla.calibrate.shipped import load_shipped, load_transforms

        if self.kind == "none":
            return {}, {}
        if self.kind == "shipped":
            if not model_name:
                raise ValueError("shipped transforms are looked up by a built-in model name; pass a file path")
            return load_shipped(model_name, self.fmt)
        return load_transforms(self.path)


def fold_source(model, source: TransformSource, model_name: str | None = None):
    """A copy of ``model`` with ``source``'s transforms folded in (the model itself when ``source`` is ``none``),
    and the file's metadata. Shipped files are checked against the model's conversion key
    (:func:`quantmla.calibrate.shipped.apply_shipped`); every file against the model's shapes and latent-norm
    gains before any weight changes."""
    from quantmla.calibrate.shipped import apply_shipped, apply_transforms

    if source.kind == "none":
        return model, {}
    out = copy.deepcopy(model)
    if source.kind == "shipped":
        if not model_name:
            raise ValueError("shipped transforms are looked up by a built-in model name; pass a file path")
        meta = apply_shipped(out, model_name, source.fmt)
    else:
        tensors, meta = source.load(model_name)
        apply_transforms(out, tensors)
    return out, {"transforms": source.label, "label": meta.get("label"), "cache_format": meta.get("cache_format")}


def mix_formats(name: str, num_layers: int) -> list[str]:
    """Per-layer format names of ``mix:FMT@L1,L2,...:OTHER`` (FMT in the listed layers, OTHER elsewhere)."""
    m = MIX_RE.match(name.strip().lower())
    if m is None:
        raise ValueError(f"{name!r} is not a mix plan (mix:FMT@LAYERS:OTHER, e.g. mix:c4r8@7,17:c4r4)")
    hot = [int(x) for x in m[2].split(",") if x]
    bad = [i for i in hot if not 0 <= i < num_layers]
    if bad or not hot:
        raise ValueError(f"{name!r}: layers {bad or hot} are not in 0..{num_layers - 1}")
    return [m[1] if i in hot else m[3] for i in range(num_layers)]


def plan_from_formats(sens, formats, dc: int, dr: int, meta: dict | None = None):
    """A :class:`~.allocate.Plan` serving ``formats[i]`` (names or CacheFormats with 2/4/8/16-bit paths) in
    layer ``i``, with the error model's predicted distortions from ``sens``; its budget is its own bytes."""
    from quantmla.analysis.allocate import BITS, Plan, path_bytes
    from quantmla.quant.formats import get_format

    if len(formats) != len(sens):
        raise ValueError(f"{len(formats)} formats for {len(sens)} layers")
    layers = []
    for s, f in zip(sens, formats, strict=True):
        fmt = get_format(f)
        bc = 16 if fmt.content is None else fmt.content.bits
        br = 16 if fmt.rope is None else fmt.rope.bits
        if bc not in BITS or br not in BITS:
            raise ValueError(f"layer {s.layer}: {fmt.name} has widths ({bc}, {br}); a plan takes {BITS}")
        name = "bf16" if bc == br == 16 else f"c{bc}r{br}"
        layers.append({"layer": s.layer, "content_bits": bc, "rope_bits": br, "format": name,
                       "bytes": path_bytes("content", bc, dc) + path_bytes("rope", br, dr),
                       "predicted": {"content": s.d("content", bc), "rope": s.d("rope", br)},
                       "sensitivity": {"content_c4": s.d("content", 4), "rope_r4": s.d("rope", 4)}})  # fmt: skip
    total = sum(r["bytes"] for r in layers)
    return Plan(dc, dr, total, layers, dict(meta or {}))


__all__ = ["MIX_RE", "TransformSource", "fold_source", "mix_formats", "plan_from_formats"]
