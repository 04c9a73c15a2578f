"""Per-layer bit allocation: one cache format per layer, chosen by the error model, under an exact byte budget.

Layers differ in how much a unit of cache error hurts (the dual-path error model: per-layer responses span a
factor of ~25 on the converted SmolLM2-MLA). So instead of one format everywhere, each attention layer l gets its
own content and RoPE bit widths ``(c_l, r_l)`` from {2, 4, 8, 16} (16 = BF16), chosen to

    minimize  sum_l  D_l,content(c_l) + D_l,rope(r_l)    subject to   sum_l bytes(c_l, r_l) <= B

where B is the budget in cache bytes per token (all layers, the packed store: codes + scales) and ``D`` is the
predicted rise of the KL divergence from the full-precision model (nats per token) when only that path of that
layer is stored at that width. It is the dual-path error model carried to the model's output: the format's real
quantization error is injected into the path (the other exact), the attention output recomputed under the cache
policy (sink and local tokens read exactly), and the output error of every token ``dO_t`` weighted by the trace of
the Fisher information of the model's next-token distributions with respect to that layer's output
(:func:`output_fisher`, one backward pass with labels sampled from the model): ``D = mean_t tr(F_t) ||dO_t||^2 /
(2 hidden)`` -- the second-order KL of an error whose direction is unrelated to ``F``'s. Distortions of different
layers are then in the same unit and add up (to second order, for independent errors).

Two simpler objectives failed on the converted SmolLM2-MLA and are why it is built this way (benchmarks/results/
allocate_smollm2.md): (1) the first-order predictor of the error (operator traces x error allocation,
:mod:`.predictor`, ``estimator="predicted"``) agrees within ~1.3x at 4 and 8 bits but underestimates 2-bit errors
by 3x to 130x (RoPE, median 8x): a trained model's attention is sharp and a 2-bit key moves logits far beyond where
the softmax is linear; (2) normalizing the attention-output error by the residual stream's energy lets a few
outlier tokens (huge residual norms) make middle layers look 1000x less sensitive than they are. Plans built on
either lost to uniform C2R4 at equal bytes (KL 4-7x higher). A MoE router whose top-k choice flips under the error
is not seen by any second-order model.

The constrained problem is a multiple-choice knapsack over 2L items (every layer's two paths, 4 choices each);
:func:`solve` solves it exactly by dynamic programming over integer bytes (tested against brute force). The plan
(:class:`Plan`) is JSON: per layer the bits, bytes, predicted distortions and sensitivity; ``Plan.formats`` is the
per-layer :class:`~quantmla.quant.formats.CacheFormat` list, and ``QuantMLACache(config, plan)`` (or
:func:`plan_cache`, which also checks the plan against the model) stores each layer in its format.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch

BITS = (2, 4, 8, 16)
PATHS = ("content", "rope")
PLAN_VERSION = 1


def path_bytes(path: str, bits: int, width: int) -> int:
    """Bytes per token of one path at ``bits`` (the default format's groups, adapted to ``width``)."""
    from quantmla.quant.formats import make_format

    fmt = make_format(bits if path == "content" else 16, bits if path == "rope" else 16)
    fmt = fmt.adapted(width, width)
    return fmt.path_bytes(path, width)


def path_spec(path: str, bits: int, width: int):
    """The QuantSpec a path uses at ``bits`` (None for 16 = BF16)."""
    from quantmla.quant.formats import make_format

    fmt = make_format(bits if path == "content" else 16, bits if path == "rope" else 16).adapted(width, width)
    return fmt.content if path == "content" else fmt.rope


# ---- the error model per (layer, path, bits) -----------------------------------------------------------------


@dataclass
class LayerSensitivity:
    """Predicted distortion of one attention layer per path and bit width: the rise of the KL divergence from the
    full-precision model (nats per token) when only that path of that layer is stored at that width."""

    layer: int
    distortion: dict = field(default_factory=dict)  # {"content": {"2": d, "4": d, "8": d, "16": 0.0}, "rope": {...}}

    def d(self, path: str, bits: int) -> float:
        return float(self.distortion[path][str(bits)])

    @property
    def sensitivity(self) -> float:
        """The layer's predicted distortion at uniform C4R4 (its x-axis in the plan plot)."""
        return self.d("content", 4) + self.d("rope", 4)


ESTIMATORS = ("measured", "predicted")


def output_fisher(
    model, tokens: torch.Tensor, batch_size: int = 2, samples: int = 2, device="cpu", seed: int = 0, progress=False
):
    """Per attention layer, per token: ``E_y ||d log p(y) / d o_t||^2`` [N, S], the trace of the Fisher information
    of the model's next-token distributions with respect to that layer's attention output ``o_t`` (what the layer
    adds to the residual stream), labels ``y`` sampled from the model itself (``samples`` draws). To second order,
    an error ``e`` in ``o_t`` raises the KL from the full-precision model by ``1/2 e^T F e``, about
    ``1/2 ||e||^2 tr(F) / D`` for an error direction unrelated to ``F``'s."""
    from quantmla.calibrate.blocks import progress_over
    from quantmla.mla.weights import iter_mla_attention

    attns = dict(iter_mla_attention(model))
    n, s = tokens.shape
    fisher = {i: torch.zeros(n, s) for i in attns}
    store: dict = {}
    grads_were = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    embed = model.get_input_embeddings()

    def grad_on(_m, _a, out):
        return out.requires_grad_(True)

    def keep(i):
        def hook(_m, _a, out):
            o = out[0] if isinstance(out, tuple) else out
            o.retain_grad()
            store[i] = o

        return hook

    handles = [embed.register_forward_hook(grad_on)] + [a.register_forward_hook(keep(i)) for i, a in attns.items()]
    gen = torch.Generator().manual_seed(seed)
    model.to(device)
    try:
        for b in progress_over(range(0, n, batch_size), "Fisher batches", progress):  # backward passes: minutes
            ids = tokens[b : b + batch_size].to(device)
            with torch.enable_grad():
                logp = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)  # [B, S, V]
                for k in range(samples):
                    y = torch.multinomial(logp.detach().exp().flatten(0, 1).cpu(), 1, generator=gen).to(device)
                    for o in store.values():
                        o.grad = None
                    logp.flatten(0, 1).gather(1, y).sum().backward(retain_graph=k + 1 < samples)
                    for i, o in store.items():
                        fisher[i][b : b + batch_size] += o.grad.float().pow(2).sum(-1).cpu() / samples
    finally:
        for h in handles:
            h.remove()
        for p, g in grads_were.items():
            p.requires_grad_(g)
    return fisher


@torch.no_grad()
def layer_sensitivity(attn, spec, hidden, fisher, cos, sin, sink, local, batch_size, query_tokens, device, seed,
                      estimator: str = "measured") -> LayerSensitivity:  # fmt: skip
    """:class:`LayerSensitivity` of one attention module from its input hidden states ``hidden`` [N, S, D] and its
    output Fisher trace per token ``fisher`` [N, S] (:func:`output_fisher`): for every path and bit width, the
    predicted rise of the KL divergence from the full-precision model, in nats per token,
    ``mean_t fisher_t ||dO_t||^2 / (2 D)``.

    ``dO`` is the change of the layer's attention output when the format's real quantization error is in one path
    (the other exact), read under the cache policy. ``measured``: the attention is recomputed with the error (the
    dual-path error model's injection); ``predicted``: the first-order predictor ``sum e^2 K`` (operator traces with
    the Fisher weight of every query), which needs no second attention pass but underestimates 2-bit errors of a
    trained model's sharp attention (softmax is not linear at that size). The RoPE key of a layer with a query-aware
    rounding plan attached (folding a transforms file with moments attaches one) is rounded by that plan at every
    bit width, as the cache's writer will round it."""
    from quantmla.analysis.predictor import operator_traces
    from quantmla.calibrate.objectives import attention_output, layer_inputs, mixed_attention_output, sample_queries
    from quantmla.mla.weights import extract_layer_weights
    from quantmla.quant.quantize import dequantize_codes, fake_quantize
    from quantmla.quant.rounding import ROPE_ROUNDING_ATTR, quantize_codes_feedback

    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator {estimator!r}; choose one of {ESTIMATORS}")
    w = extract_layer_weights(attn).to(device=device, dtype=torch.float32)
    plan = getattr(attn, ROPE_ROUNDING_ATTR, None)
    plan = None if plan is None else plan.to(device)
    gen = torch.Generator().manual_seed(seed)
    cos, sin = cos.to(device), sin.to(device)
    acc = {p: dict.fromkeys(BITS[:-1], 0.0) for p in PATHS}
    count = 0
    scale = 1.0 / (2 * hidden.shape[-1])
    for i in range(0, hidden.shape[0], batch_size):
        h = hidden[i : i + batch_size].to(device).float()
        qidx = sample_queries(h.shape[1], query_tokens, gen)
        x = layer_inputs(w, spec, h, cos, sin, qidx, sink, local)
        f = fisher[i : i + batch_size]
        f = (f if qidx is None else f[:, qidx]).to(device).float() * scale  # [B, Tq]
        count += f.numel()
        if estimator == "predicted":
            reads = x.quant_mask.to(f.dtype)[None, None] * f[:, None, :, None]  # [B, 1, Tq, S]
            k_c, k_r = operator_traces(x, w, spec, reads=reads)
        else:
            ref = attention_output(x, w, spec, x.c, x.k_pe)
        for path, clean in (("content", x.c), ("rope", x.k_pe)):
            for bits in BITS[:-1]:
                pspec = path_spec(path, bits, clean.shape[-1])
                if path == "rope" and plan is not None:  # as the cache's writer rounds this layer's RoPE key
                    rot = plan.rotate(clean)  # (stored after the plan's post-RoPE rotation, read back in these axes)
                    q = plan.unrotate(dequantize_codes(*quantize_codes_feedback(rot, pspec, plan), pspec).float())
                else:
                    q = fake_quantize(clean, pspec).float()
                if estimator == "predicted":
                    acc[path][bits] += float(((q - clean).pow(2) * (k_c if path == "content" else k_r)).sum())
                    continue
                c, k = (q, x.k_pe) if path == "content" else (x.c, q)
                err = (mixed_attention_output(x, w, spec, c, k) - ref).pow(2).sum(-1)  # [B, Tq]
                acc[path][bits] += float((err * f).sum())
    dist = {p: {str(b): acc[p][b] / max(count, 1) for b in BITS[:-1]} | {"16": 0.0} for p in PATHS}
    return LayerSensitivity(attn.layer_idx, dist)


def model_sensitivities(
    model, tokens, *, sink=4, local=128, batch_size=2, query_tokens=128, device="auto", estimator="measured",
    fisher_samples=2, progress=False, seed=0,
) -> list[LayerSensitivity]:  # fmt: skip
    """Every attention layer's :class:`LayerSensitivity` on calibration ``tokens`` [N, S] (the model is not
    modified): the output Fisher of every layer first (one backward pass per sample), then block by block the
    distortions. ``sink``/``local``: the cache policy the plan will be served with."""
    from quantmla.calibrate.blocks import (
        attention_by_block,
        decoder_blocks,
        device_of,
        first_block_inputs,
        progress_over,
        resolve_device,
        run_block,
    )
    from quantmla.mla.rope import cos_sin_from_position_embeddings
    from quantmla.mla.spec import MLASpec

    spec = MLASpec.from_config(model.config)
    dev = resolve_device(device)
    tokens = torch.as_tensor(tokens).long()
    if tokens.dim() != 2 or tokens.shape[1] <= sink + local:
        raise ValueError(
            f"sensitivity tokens must be [N, S] with S > sink + local = {sink + local} (else no key is read "
            f"quantized), got {tuple(tokens.shape)}"
        )
    model.eval()
    home = device_of(model)
    fisher = output_fisher(model, tokens, batch_size, fisher_samples, dev, seed, progress)
    if home is not None:
        model.to(home)
    _, blocks = decoder_blocks(model)
    attns = attention_by_block(model, blocks)
    h, kwargs = first_block_inputs(model, tokens, batch_size, dev)
    out = []
    for b, block in enumerate(progress_over(blocks, "layers", progress)):
        home = device_of(block)
        block.to(dev)
        try:
            h_next, inputs, pe = run_block(block, attns[b], h, kwargs, batch_size, dev)
        finally:
            if home is not None:
                block.to(home)
        cos, sin = cos_sin_from_position_embeddings(pe)
        for attn, x in zip(attns[b], inputs, strict=True):
            out.append(layer_sensitivity(attn, spec, x, fisher[attn.layer_idx], cos[:1].float(), sin[:1].float(),
                                         sink, local, batch_size, query_tokens, dev, seed + attn.layer_idx,
                                         estimator))  # fmt: skip
        h = h_next
    return out


# ---- the exact solver ----------------------------------------------------------------------------------------


def solve(costs: list[list[float]], sizes: list[list[int]], budget: int) -> list[int]:
    """Exact multiple-choice knapsack: pick one option per item minimizing the summed cost with summed size <=
    ``budget`` (integers). Ties go to fewer bytes, then to the earlier option. Raises ValueError when even the
    smallest options exceed the budget."""
    if budget < 0 or int(budget) != budget:
        raise ValueError(f"budget must be a non-negative integer number of bytes, got {budget!r}")
    budget = int(budget)
    minimum = sum(min(s) for s in sizes)
    if minimum > budget:
        raise ValueError(f"budget {budget} B/token is below the smallest plan ({minimum} B/token, every path 2-bit)")
    import numpy as np

    cap = budget - minimum  # bytes above the all-smallest plan
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0  # best[b]: least cost using exactly b bytes above the smallest options so far
    choice = []
    for cost, size in zip(costs, sizes, strict=True):
        lo = min(size)
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1, dtype=np.int64)
        for o, (c, sz) in enumerate(zip(cost, size, strict=True)):
            extra = sz - lo
            if extra > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[extra:] = best[: cap + 1 - extra] + c
            better = cand < new  # strict: an earlier option keeps a tie
            new[better], pick[better] = cand[better], o
        best = new
        choice.append(pick)
    end = int(np.flatnonzero(best == best.min())[0])  # the least cost, then the fewest bytes
    out = []
    for item in range(len(costs) - 1, -1, -1):
        o = int(choice[item][end])
        out.append(o)
        end -= sizes[item][o] - min(sizes[item])
    return out[::-1]


# ---- the plan ------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """One format per attention layer, with what the error model predicted for it."""

    kv_lora_rank: int
    rope_dim: int
    budget_bytes_per_token: int
    layers: list[dict]  # {"layer", "content_bits", "rope_bits", "format", "bytes", "predicted", "sensitivity"}
    meta: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    @property
    def bytes_per_token(self) -> int:
        return sum(r["bytes"] for r in self.layers)

    @property
    def predicted_distortion(self) -> float:
        return sum(r["predicted"]["content"] + r["predicted"]["rope"] for r in self.layers)

    @property
    def formats(self):
        """The per-layer :class:`CacheFormat` list (groups adapted to the model's path widths); what
        ``QuantMLACache(config, plan)`` stores layer by layer."""
        from quantmla.quant.formats import make_format

        return [make_format(r["content_bits"], r["rope_bits"]).adapted(self.kv_lora_rank, self.rope_dim)
                for r in self.layers]  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self) | {"bytes_per_token": self.bytes_per_token,
                               "predicted_distortion": self.predicted_distortion}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('version')!r} is not supported (expected {PLAN_VERSION})")
        for r in d["layers"]:
            if r["content_bits"] not in BITS or r["rope_bits"] not in BITS:
                raise ValueError(f"plan layer {r['layer']}: bits must be in {BITS}")
        keys = ("kv_lora_rank", "rope_dim", "budget_bytes_per_token", "layers", "meta", "version")
        return cls(**{k: d[k] for k in keys if k in d})

    def save(self, path: str, *, force: bool = False) -> str:
        """Write the plan as JSON (temp file + rename); refuses to overwrite without ``force``."""
        from quantmla.eval.harness import write_result

        return write_result(self.to_dict(), path, force=force)

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def uniform_bytes(bits_c: int, bits_r: int, dc: int, dr: int, layers: int) -> int:
    return layers * (path_bytes("content", bits_c, dc) + path_bytes("rope", bits_r, dr))


def budget_from_avg_bits(avg_bits: float, dc: int, dr: int, layers: int) -> int:
    """Bytes per token for an average of ``avg_bits`` per cached value, scales and offsets included."""
    if not avg_bits > 0:
        raise ValueError(f"--avg-bits must be > 0, got {avg_bits!r}")
    return int(math.floor(avg_bits * (dc + dr) * layers / 8))


def allocate(sens: list[LayerSensitivity], dc: int, dr: int, budget: int, meta: dict | None = None) -> Plan:
    """The plan minimizing the summed predicted distortion with at most ``budget`` cache bytes per token."""
    costs, sizes = [], []
    for s in sens:
        for path, width in (("content", dc), ("rope", dr)):
            costs.append([s.d(path, b) for b in BITS])
            sizes.append([path_bytes(path, b, width) for b in BITS])
    pick = solve(costs, sizes, budget)
    layers = []
    for i, s in enumerate(sens):
        bc, br = BITS[pick[2 * i]], BITS[pick[2 * i + 1]]
        name = "bf16" if bc == br == 16 else f"c{bc}r{br}"
        layers.append({"layer": s.layer, "content_bits": bc, "rope_bits": br, "format": name,
                       "bytes": sizes[2 * i][pick[2 * i]] + sizes[2 * i + 1][pick[2 * i + 1]],
                       "predicted": {"content": s.d("content", bc), "rope": s.d("rope", br)},
                       "sensitivity": {"content_c4": s.d("content", 4), "rope_r4": s.d("rope", 4)}})  # fmt: skip
    return Plan(dc, dr, int(budget), layers, dict(meta or {}))


def predicted_uniform(sens: list[LayerSensitivity], bits_c: int, bits_r: int) -> float:
    return sum(s.d("content", bits_c) + s.d("rope", bits_r) for s in sens)


# ---- using a plan --------------------------------------------------------------------------------------------


def plan_cache(config, plan: Plan, policy=None, rope_rounding: list | None = None):
    """A :class:`~quantmla.cache.hf.QuantMLACache` whose layer ``i`` stores ``plan.formats[i]`` (the cache takes
    per-layer formats itself; this only checks the plan's widths against the model's first). ``rope_rounding``: the
    model's query-aware RoPE rounding plans (:func:`quantmla.cache.hf.rope_rounding_of`), or None."""
    from quantmla.cache.hf import QuantMLACache
    from quantmla.mla.spec import MLASpec

    spec = MLASpec.from_config(config)
    if (plan.kv_lora_rank, plan.rope_dim) != (spec.kv_lora_rank, spec.qk_rope_head_dim):
        raise ValueError(
            f"the plan is for latent {plan.kv_lora_rank} + RoPE {plan.rope_dim}, the model has "
            f"{spec.kv_lora_rank} + {spec.qk_rope_head_dim}: made for another model"
        )
    if len(plan.layers) != spec.num_cache_layers:
        raise ValueError(
            f"the plan has {len(plan.layers)} layers, the model {spec.num_cache_layers}: made for another model"
        )
    return QuantMLACache(config, plan, policy, rope_rounding=rope_rounding)


def plan_bytes(plan: Plan, context: int, policy=None) -> int:
    """Physical bytes of one sequence of ``context`` tokens cached with ``plan`` (buffers, scales, table)."""
    from quantmla.quant.formats import cache_bytes

    total = 0
    for i, f in enumerate(plan.formats):
        b = cache_bytes(f, kv_lora_rank=plan.kv_lora_rank, rope_dim=plan.rope_dim, num_layers=1, context=context,
                        policy=policy)  # fmt: skip
        total += b.total - (b.metadata if i else 0)  # the block table is shared by all layers
    return total


def plot_plan(plan: Plan, path: str, title: str = "", marks=()) -> str | None:
    """PNG of the plan: bits per layer (bars) over the layers' predicted sensitivity (line, log scale), and each
    path's bits against its sensitivity; ``marks``: layers to flag (e.g. a hand plan's). Written to a temp file and
    renamed; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    idx = [r["layer"] for r in plan.layers]
    sc = [r["sensitivity"]["content_c4"] for r in plan.layers]
    sr = [r["sensitivity"]["rope_r4"] for r in plan.layers]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [2.2, 1]})
    wbar = 0.4
    ax.bar([i - wbar / 2 for i in idx], [r["content_bits"] for r in plan.layers], wbar, label="content bits")
    ax.bar([i + wbar / 2 for i in idx], [r["rope_bits"] for r in plan.layers], wbar, label="RoPE bits")
    ax.set_yticks(BITS)
    ax.set_xlabel("attention layer")
    ax.set_ylabel("bits (16 = BF16)")
    tw = ax.twinx()
    tw.plot(idx, sc, "k-", lw=1, label="content, 4 bits")
    tw.plot(idx, sr, "k--", lw=1, label="RoPE, 4 bits")
    for i, m in enumerate(sorted(marks)):
        ax.axvspan(m - 0.5, m + 0.5, color="0.85", zorder=0, label="marked layers" if i == 0 else None)
    tw.set_yscale("log")
    tw.set_ylabel("predicted KL rise at 4 bits (nats/token)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = tw.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax.set_title(title or f"plan: {plan.bytes_per_token} B/token (budget {plan.budget_bytes_per_token})")
    ax2.scatter(sc, [r["content_bits"] for r in plan.layers], label="content", marker="o")
    ax2.scatter(sr, [r["rope_bits"] for r in plan.layers], label="RoPE", marker="^")
    ax2.set_xscale("log")
    ax2.set_yticks(BITS)
    ax2.set_xlabel("layer's predicted KL rise at 4 bits")
    ax2.set_ylabel("bits chosen")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


__all__ = [
    "BITS",
    "LayerSensitivity",
    "Plan",
    "allocate",
    "budget_from_avg_bits",
    "model_sensitivities",
    "path_bytes",
    "plan_bytes",
    "plan_cache",
    "plot_plan",
    "predicted_uniform",
    "solve",
    "uniform_bytes",
]
