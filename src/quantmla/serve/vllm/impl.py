"""The QuantMLA forward path inside vLLM's MLA layer: metadata builder and attention impl (imports vLLM).

vLLM's ``MLAAttention`` layer (0.32/0.33), per forward: ``impl.do_kv_cache_update(kv_c_normed [N, Dc], k_pe [N, 1,
Dr], kv_cache, slot_mapping)``, then its decode rows (batch reordered: decodes first) through
``impl.forward_mqa((q_lat [B, H, Dc], q_pe [B, H, Dr]), kv_cache, metadata, layer)`` -- it has absorbed the query
through ``W_UK`` already and applies ``W_UV`` to what we return -- and its prefill rows through
``impl.forward_mha(q [T, H, Dn + Dr], ..., output [T, H * Dv])``. Here:

* **write**: :meth:`ServeLayer.write` -- the torch reference writer on the CPU, the fused Triton writer on CUDA
  (bit-identical), BF16 sink/local copies into the per-request table; the slot mapping is checked against the
  block table;
* **decode**: :meth:`ServeLayer.decode` -> :func:`quantmla.kernels.decode_attention`;
* **prefill**: absorbed attention (``q_lat = q_nope W_UK``, the layer's ``W_UV`` on the way out) with every query
  reading each token through the cache policy (:meth:`ServeLayer.prefill`), so a prompt sees what token-by-token
  decoding would, as ``quantmla generate --absorbed`` does. A dequantizing gather into vLLM's own MHA prefill
  cannot express the per-query policy (each query reads a different mix of BF16 and packed copies).

``do_kv_cache_update`` gets no request boundaries: the builder puts them (and the request ids of the batch rows,
reported by the model-runner hook of :mod:`quantmla.serve.vllm.adapter`) into :class:`QuantMLAMetadata`, which
the impl reads back from vLLM's forward context. Batches that are not real requests (profiling, warm-up) are
skipped: nothing written, zeros out. The host-side bookkeeping rules out CUDA graphs (``NEVER``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonPrefillMetadata,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, MLAAttentionImpl
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from quantmla.serve.slots import CACHE_DTYPES
from quantmla.serve.vllm.worker import WorkerCache, all_worker_caches, register_worker_cache, worker_cache


@dataclass
class QuantMLAMetadata(MLACommonMetadata):
    """vLLM's MLA metadata plus what the QuantMLA cache needs on the host: the batch rows' request ids (None for a
    batch that is not real requests), ``query_start_loc`` and lengths after the step, the block table."""

    req_ids: list[str] | None = None
    qsl_cpu: torch.Tensor | None = None  # [B + 1] int
    seq_lens_cpu: torch.Tensor | None = None  # [B] int, lengths after this step's tokens
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32
    cache: WorkerCache | None = field(default=None, repr=False)


def _worker_cache_for(vllm_config) -> WorkerCache:
    cache = worker_cache(vllm_config)
    if cache is None:
        caches = all_worker_caches()
        if len(caches) != 1:
            raise RuntimeError("the QuantMLA metadata builder found no QuantMLA attention layer for this engine")
        cache = caches[0]
    return cache


class QuantMLAMetadataBuilder(AttentionMetadataBuilder[QuantMLAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int = 1  # decode rows (one query token) first, as vLLM's MLA layer expects

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:  # noqa: D107
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from quantmla.serve.vllm.runner_hooks import install_runner_hooks

        self.cache = _worker_cache_for(vllm_config)
        install_runner_hooks()

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> QuantMLAMetadata:
        m = common_attn_metadata
        B = m.num_reqs
        nd, npf, ndt, _ = split_decodes_and_prefills(m, decode_threshold=1)
        seq_lens_cpu = m.seq_lens[:B].cpu()
        qsl_cpu = m.query_start_loc_cpu[: B + 1]
        bt = m.block_table_tensor[:B]
        decode = prefill = None
        if nd:
            decode = MLACommonDecodeMetadata(block_table=bt[:nd], seq_lens=m.seq_lens[:nd], dcp_tot_seq_lens=None)
        if npf:
            qsl = m.query_start_loc[nd : B + 1]
            prefill = MLACommonPrefillMetadata(block_table=bt[nd:], query_start_loc=qsl - qsl[0],
                                               max_query_len=m.max_query_len)  # fmt: skip
        return QuantMLAMetadata(
            num_reqs=B, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc, slot_mapping=m.slot_mapping,
            num_decodes=nd, num_decode_tokens=ndt, num_prefills=npf, prefill=prefill, decode=decode,
            req_ids=self.cache.begin_step(B), qsl_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, block_table=bt,
            cache=self.cache,
        )  # fmt: skip


class QuantMLAImpl(MLAAttentionImpl[QuantMLAMetadata]):
    """One MLA layer over the QuantMLA cache (see the module docstring). Start-up checks in ``__init__``."""

    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:  # fmt: skip  # noqa: D107
        from vllm.config import get_current_vllm_config

        from quantmla.serve.vllm.config import (
            BACKEND_NAME,
            check_config,
            geometry,
            requested_cache_dtype,
            rounding_plans,
        )

        cfg = get_current_vllm_config()
        cache_dtype = requested_cache_dtype(cfg)
        if cache_dtype is None:
            raise ValueError(
                f"the {BACKEND_NAME} attention backend serves the QuantMLA cache dtypes {sorted(CACHE_DTYPES)}; "
                "pass --kv-cache-dtype (vLLM 0.33) or --additional-config '{\"quantmla_kv_cache_dtype\": ...}'"
            )
        device = torch.device(cfg.device_config.device_type)
        reasons = check_config(cfg, cache_dtype, device)
        unsupported = {"alibi slopes": alibi_slopes, "a sliding window": sliding_window,
                       "a logits soft cap": logits_soft_cap, "KV sharing": kv_sharing_target_layer_name}  # fmt: skip
        reasons += [f"the model uses {k}" for k, v in unsupported.items() if v]
        if str(attn_type).lower().split(".")[-1] != "decoder":
            reasons.append(f"attention type {attn_type}: only decoder self-attention")
        if reasons:
            raise ValueError(f"cannot serve {cache_dtype} with this configuration: " + "; ".join(reasons))
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        self.kv_lora_rank = mla_args["kv_lora_rank"]
        self.qk_nope_head_dim, self.qk_rope_head_dim = mla_args["qk_nope_head_dim"], mla_args["qk_rope_head_dim"]
        self.v_head_dim, self.kv_b_proj = mla_args["v_head_dim"], mla_args["kv_b_proj"]
        self.q_pad_num_heads = None
        self.dcp_world_size = 1
        cache = worker_cache(cfg)
        if cache is None:
            geo = geometry(cfg, cache_dtype)
            plans, first = rounding_plans(cfg)
            cache = register_worker_cache(cfg, WorkerCache(geo, cfg.scheduler_config.max_num_seqs, device,
                                                           rope_rounding=plans, first_layer=first))  # fmt: skip
        self.cache = cache
        self.serve = cache.add_layer()  # allocated with the first layer: before vLLM measures memory
        self._layer = self._layer_name = None

    # -- where this layer is ------------------------------------------------------------------------
    def _find_layer(self) -> None:
        for name, layer in get_forward_context().no_compile_layers.items():
            if getattr(layer, "impl", None) is self:
                self._layer, self._layer_name = layer, name
                return
        raise RuntimeError("the QuantMLA attention impl is not in vLLM's forward context")

    def _metadata(self) -> QuantMLAMetadata | None:
        if self._layer_name is None:
            self._find_layer()
        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            raise RuntimeError("micro-batching (DBO) is not supported by the QuantMLA backend")
        return md.get(self._layer_name) if isinstance(md, dict) else md

    # -- the three entry points -----------------------------------------------------------------------
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                           skip_scale: bool = False) -> None:  # fmt: skip (0.33 adds skip_scale, an FP8 detail)
        if kv_cache.numel() == 0:
            return
        md = self._metadata()
        if md is None or md.req_ids is None:
            return
        n = md.num_actual_tokens
        self.cache.recent[self.serve.layer] = self.serve.write(
            kv_cache, self.cache.table, md.req_ids, kv_c_normed[:n], k_pe[:n], md.qsl_cpu, md.seq_lens_cpu,
            md.block_table, slot_mapping[:n],
        )  # fmt: skip

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: QuantMLAMetadata, layer):
        q_lat, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        md = attn_metadata
        if md.req_ids is None:
            return q_lat.new_zeros(q_lat.shape), None
        nd = md.num_decodes
        o, _ = self.serve.decode(kv_c_and_k_pe_cache, self.cache.table, q_lat, q_pe, md.seq_lens_cpu[:nd],
                                 md.block_table[:nd], self.scale)  # fmt: skip
        return o.to(q_lat.dtype), None

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata: QuantMLAMetadata, k_scale,
                    output, output_scale=None) -> None:  # fmt: skip
        if output_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the QuantMLA backend")
        md = attn_metadata
        if md.req_ids is None:
            output.zero_()
            return
        if self._layer is None:
            self._find_layer()
        nd = md.num_decodes
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)  # [T, H, Dn], [T, H, Dr]
        w_uk_t = self._layer.W_UK_T  # [H, Dn, Dc]
        q_lat = torch.bmm(q_nope.transpose(0, 1).float(), w_uk_t.float()).transpose(0, 1)  # [T, H, Dc] fp32
        recent = self.cache.recent.get(self.serve.layer)
        o_lat = self.serve.prefill(
            kv_c_and_k_pe_cache, self.cache.table, q_lat, q_pe, md.qsl_cpu[nd:] - md.qsl_cpu[nd],
            md.seq_lens_cpu[nd:], md.block_table[nd:], self.scale, recent=None if recent is None else recent[nd:],
            first_row=nd,
        )  # [T, H, Dc] fp32, fmt: skip
        self._layer._v_up_proj(o_lat.to(output.dtype), out=output)
