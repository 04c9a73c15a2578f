"""End-to-end generation through ``QuantMLACache``: decode speed, prompt ingestion and how many sequences fit.

Models: ``v2-lite`` (transformers' ``DeepseekV2ForCausalLM`` built from DeepSeek-V2-Lite's public config with random
BF16 weights: the real shapes, 15.7B parameters, nothing downloaded), ``smollm2-mla`` (the converted SmolLM2 model
from the local cache, see ``quantmla convert``) and ``tiny`` (a tiny random DeepSeek-V2, for the CPU smoke run).
The model runs in absorbed form (:func:`quantmla.mla.attention.enable_absorbed_attention`) over a ``QuantMLACache``
of each format, so every step goes through the fused writer and ``decode_attention(impl="auto")`` (CUDA C++ kernel
for C4R4/C2R4 on sm_80+, Triton otherwise); ``hf`` is transformers' own ``DynamicCache`` with the model's own
attention (the stock BF16 path), where it fits.

What is measured, per model:

* ``check``: before any timing, one prompt (300 tokens, batch 2) and one decode step per format with the fast path
  against the same run forced onto the fp32 torch references (``force_impl("torch")``): relative L2 error and top-1
  agreement of the logits;
* ``decode``: the cache is filled with ``context`` random latents per sequence (written through the cache, as a
  prompt's would be: the speed of a step does not depend on the values), then ``--steps`` greedy steps of the whole
  model are timed (CUDA synchronized around each step; median). Time per output token (TPOT) and tokens/s =
  batch / TPOT, at every batch x context that fits in the free GPU memory;
* ``prefill``: one forward of a ``context``-token prompt (batch 1) into a fresh cache: tokens/s of prompt ingestion;
* ``budget``: the largest batch whose cache fits ``--budget-gib`` at ``--budget-context`` tokens, measured by
  allocating it (bytes from the cache's own accounting, and ``torch.cuda.memory_allocated`` on a GPU).

Writes ``generate_<tag>.{json,md,png}`` to ``--out`` (refuses to overwrite without ``--force``) and prints one JSON
line last. On the GPU machine::

    PYTHONPATH=src python benchmarks/bench_generate.py --models v2-lite,smollm2-mla --tag h200
    PYTHONPATH=src python benchmarks/bench_generate.py --tiny --out /tmp/bench   # CPU smoke run (seconds)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

from quantmla.cache.hf import QuantMLACache
from quantmla.kernels.dispatch import force_impl
from quantmla.mla.attention import disable_absorbed_attention, enable_absorbed_attention
from quantmla.quant.formats import CachePolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate_report import write_outputs  # noqa: E402 - the JSON, markdown tables and plot
from results_io import gpu_tag  # noqa: E402

# DeepSeek-V2-Lite's config.json (public), the fields transformers' DeepseekV2Config reads.
V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
    first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=100000, eos_token_id=100001, attention_bias=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                         beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
)  # fmt: skip
POLICY = CachePolicy(sink=4, local=128, page_size=64)
DEFAULTS = dict(models="v2-lite,smollm2-mla", batches="1,8,32", contexts="4096,32768,131072",
                prefill_contexts="4096,32768", steps=16, warmup=3, budget_gib=40.0, budget_context=131072)
TINY = dict(models="tiny", batches="1,3", contexts="40,300", prefill_contexts="200", steps=2, warmup=1,
            budget_gib=0.01, budget_context=2048)  # fmt: skip


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


class Stopped(Exception):
    """SIGTERM arrived (e.g. from ``timeout``): the rows measured so far are written, marked partial."""


def _on_sigterm(signum, frame):
    raise Stopped(f"signal {signum}")


def build_model(name: str, device: str):
    """(model in eval mode, absorbed attention on; description)."""
    if name == "v2-lite":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        cfg = DeepseekV2Config(**V2_LITE)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = DeepseekV2ForCausalLM(cfg)  # random BF16 weights, initialized on the device
        finally:
            torch.set_default_dtype(old)
        desc = "DeepSeek-V2-Lite shapes, random BF16 weights"
    elif name == "smollm2-mla":
        from quantmla.models.names import resolve_model

        model = resolve_model("smollm2-mla", "bfloat16" if device == "cuda" else "float32")[0].to(device)
        desc = "SmolLM2-135M converted to MLA (variant a)"
    elif name == "tiny":
        from quantmla.mla.tiny import tiny_model

        model = tiny_model("deepseek_v2").to(device)
        desc = "tiny random DeepSeek-V2 (smoke run)"
    else:
        raise SystemExit(f"unknown model {name!r}: choose v2-lite, smollm2-mla or tiny")
    model.eval()
    enable_absorbed_attention(model)
    return model, desc


def new_cache(model, fmt: str, max_length: int | None):
    if fmt == "hf":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    return QuantMLACache(model.config, fmt, POLICY, max_length=max_length)


def forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits of the last position [B, V]; ``hf`` caches run the model's own attention."""
    from quantmla.compat import with_cache

    own = not isinstance(cache, QuantMLACache)
    if own:
        disable_absorbed_attention(model)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **with_cache(cache))
            return out.logits[:, -1].float()
    finally:
        if own:
            enable_absorbed_attention(model)


def fill(cache, spec, batch: int, n: int, device: str, dtype: torch.dtype, chunk: int = 8192, seed: int = 0) -> None:
    """``n`` random latents per sequence in every layer (unit scale, as after the latent norm), written through the
    cache as a prompt's would be (a step's speed does not depend on the values). ``hf``: straight into the
    ``DynamicCache`` the model's own attention reads."""
    g = torch.Generator(device=device).manual_seed(seed)
    for i in range(spec.num_cache_layers):
        for t0 in range(0, n, chunk):
            t = min(chunk, n - t0)
            c = torch.randn(batch, t, spec.kv_lora_rank, generator=g, device=device, dtype=dtype)
            k = torch.randn(batch, t, spec.qk_rope_head_dim, generator=g, device=device, dtype=dtype)
            if isinstance(cache, QuantMLACache):
                lay = cache.mla_layer(i)
                lay.write(c, k)
                lay.flush()
            else:
                cache.update(c[:, None], k[:, None], i)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(step, steps: int, warmup: int, device: str) -> float:
    """Median wall seconds of ``steps`` synchronized calls of ``step()``, after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(model, fmt: str, device: str, n: int = 300) -> dict:
    """Fast path vs the fp32 torch references: a prompt of ``n`` tokens (batch 2) and one decode step."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, n + 1), generator=g).to(device)
    out = {}
    for label, impl in (("fast", "auto"), ("torch", "torch")):
        cache = new_cache(model, fmt, n + 1)
        with force_impl(impl):
            pre = forward(model, ids[:, :n], cache)
            dec = forward(model, ids[:, n:], cache)
        out[label] = (pre, dec)
    res = {}
    for i, what in enumerate(("prefill", "decode")):
        a, b = out["fast"][i], out["torch"][i]
        res[f"{what}_rel_l2"] = float((a - b).norm() / b.norm())
        res[f"{what}_top1"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return res


def fits(model, fmt: str, batch: int, n: int, device: str, margin: float = 1.15) -> tuple[bool, float]:
    """Whether a ``batch x n`` cache of ``fmt`` (plus transient headroom) fits the free device memory; GiB needed."""
    from quantmla.mla.spec import MLASpec
    from quantmla.quant.formats import cache_bytes

    spec = MLASpec.from_config(model.config)
    f = "bf16" if fmt == "hf" else fmt
    need = cache_bytes(f, kv_lora_rank=spec.kv_lora_rank, rope_dim=spec.qk_rope_head_dim,
                       num_layers=spec.num_cache_layers, context=n, batch=batch, policy=POLICY).total  # fmt: skip
    if fmt == "hf":  # the model's own attention re-expands the whole latent every step: K and V of every head
        need += batch * n * spec.num_heads * (spec.qk_head_dim + spec.v_head_dim) * 2 * 2
    if device != "cuda":
        return True, need / 2**30
    free = torch.cuda.mem_get_info()[0]
    return need * margin + (2 << 30) < free, need / 2**30


def time_decode(model, fmt: str, batch: int, n: int, steps: int, warmup: int, device: str,
                graph: bool = False) -> dict:  # fmt: skip
    """Median time per output token of eager decode steps; with ``graph`` (CUDA, our cache) also of the same step
    captured in a CUDA graph and replayed (:class:`quantmla.cache.graph.CapturedDecode`), on the same cache after
    the eager steps."""
    graph = graph and fmt != "hf"
    cap = n + steps + warmup + 1 + (steps + 2 if graph else 0)
    cache = new_cache(model, fmt, cap)
    from quantmla.mla.spec import MLASpec

    fill(cache, MLASpec.from_config(model.config), batch, n, device, model.dtype)
    ids = [torch.randint(0, model.config.vocab_size, (batch, 1), device=device)]  # the next tokens, step to step

    def eager() -> None:
        ids[0] = forward(model, ids[0], cache).argmax(-1, keepdim=True)

    tpot = median_seconds(eager, steps, warmup, device)
    row = {"tpot_ms": 1e3 * tpot, "tok_s": batch / tpot}
    if graph:
        from quantmla.cache.graph import CapturedDecode

        t0 = time.perf_counter()
        try:
            captured = CapturedDecode(model, cache, max_length=cap)
        except ValueError as e:  # a model or cache the capture refuses: said in the row, the eager rows stand
            row["graph_skipped"] = str(e)
            captured = None
        capture_s = time.perf_counter() - t0

        def replay() -> None:
            ids[0] = captured.step(ids[0]).argmax(-1, keepdim=True)

        if captured is not None:
            g = median_seconds(replay, steps, 1, device)
            row.update(graph_tpot_ms=1e3 * g, graph_tok_s=batch / g, capture_s=capture_s)
    if isinstance(cache, QuantMLACache):
        row["cache_bytes"] = cache.memory_report()["allocated_bytes"]
    return row


def ingest(model, ids: torch.Tensor, cache, chunk: int, device: str) -> list[float]:
    """Feed the prompt ``ids`` [B, n] into ``cache`` in forwards of ``chunk`` tokens (one forward when 0): the
    synchronized wall seconds of each forward."""
    step = chunk if chunk > 0 else ids.shape[1]
    times = []
    for s in range(0, ids.shape[1], step):
        sync(device)
        t0 = time.perf_counter()
        forward(model, ids[:, s : s + step], cache)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def time_prefill(model, fmt: str, n: int, device: str, reps: int = 2, chunk: int = 0) -> dict:
    """One ``n``-token prompt into a fresh cache (best of ``reps``); ``chunk`` > 0: in forwards of ``chunk`` tokens
    (a serving engine's chunked prefill), each timed: ``chunk_seconds[i]`` is the chunk at ``i * chunk`` cached."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
    step = chunk if chunk > 0 else n
    best: list[float] = []
    for _ in range(reps):
        cache = new_cache(model, fmt, n + 1)
        times = ingest(model, ids, cache, step, device)
        del cache
        best = times if not best or sum(times) < sum(best) else best
    row = {"seconds": sum(best), "prompt_tok_s": n / sum(best)}
    return {**row, "chunk": step, "chunk_seconds": best} if chunk > 0 else row


def budget_batch(model, fmt: str, n: int, budget: int, device: str) -> dict:
    """The largest batch of ``n``-token sequences whose cache fits ``budget`` bytes, found from the allocation of
    batches 1 and 2 and then allocated to confirm."""

    def held(b: int) -> tuple[int, int]:
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        cache = new_cache(model, fmt, n)
        for i in range(len(cache.layers)):  # the first write allocates every page of max_length
            lay = cache.mla_layer(i)
            lay.write(torch.zeros(b, 1, cache.spec.kv_lora_rank, device=device, dtype=model.dtype),
                      torch.zeros(b, 1, cache.spec.qk_rope_head_dim, device=device, dtype=model.dtype))  # fmt: skip
            lay.flush()
        sync(device)
        got = (cache.memory_report()["allocated_bytes"], torch.cuda.memory_allocated() - before if device == "cuda"
               else cache.memory_report()["allocated_bytes"])  # fmt: skip
        del cache
        if device == "cuda":
            torch.cuda.empty_cache()
        return got

    one, two = held(1)[0], held(2)[0]
    per_seq, fixed = two - one, 2 * one - two
    best = max(0, (budget - fixed) // per_seq)
    row = {"per_sequence_bytes": per_seq, "max_batch": int(best)}
    if best and (device == "cuda" or best * per_seq <= 1 << 30):
        report, allocator = held(int(best))
        row.update(allocated_bytes=report, allocator_bytes=allocator, fits=report <= budget and allocator <= budget)
    return row


def run_model(name: str, args, device: str, rows: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """Every measurement of one model; rows are appended to ``rows`` as they are measured (kept if stopped)."""
    log(f"== {name}: building")
    t0 = time.perf_counter()
    model, desc = build_model(name, device)
    info = {"model": name, "description": desc, "build_s": time.perf_counter() - t0,
            "params": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype)}  # fmt: skip
    rows = [] if rows is None else rows
    formats = [f for f in args.formats if f != "hf"]
    bad = set()
    for f in formats:
        r = check(model, f, device)
        ok = (r["prefill_rel_l2"] < args.check_tol and r["decode_rel_l2"] < args.check_tol
              and min(r["prefill_top1"], r["decode_top1"]) >= args.check_top1)
        rows.append({"model": name, "kind": "check", "format": f, **r, "ok": ok})
        log(f"   check {f}: {r}")
        if not ok:
            bad.add(f)  # reported, never timed
    budget = int(args.budget_gib * 2**30)
    for f in formats:  # first: cheap, and kept if a time limit stops the run later
        r = budget_batch(model, f, args.budget_context, budget, device)
        rows.append({"model": name, "kind": "budget", "format": f, "context": args.budget_context,
                     "budget_bytes": budget, **r})  # fmt: skip
        log(f"   budget {f}: {r}")
    for n in args.contexts:
        for b in args.batches:
            for f in args.formats:
                if f in bad:
                    continue
                base = {"model": name, "kind": "decode", "format": f, "batch": b, "context": n}
                if f == "hf" and b * n > args.hf_max_tokens:
                    continue
                ok, gib = fits(model, f, b, n, device)
                if not ok:
                    rows.append({**base, "skipped": f"needs ~{gib:.1f} GiB for the cache, more than is free"})
                    continue
                try:
                    r = time_decode(model, f, b, n, args.steps, args.warmup, device, graph=args.graph)
                except torch.OutOfMemoryError:
                    r = {"skipped": "out of memory"}
                rows.append({**base, **r})
                log(f"   decode {f} B{b} N{n}: {r}")
                if device == "cuda":
                    torch.cuda.empty_cache()
    for n in args.prefill_contexts:
        for f in args.formats:
            if f in bad:
                continue
            try:
                r = time_prefill(model, f, n, device, chunk=args.prefill_chunk)
            except torch.OutOfMemoryError:
                r = {"skipped": "out of memory"}
            rows.append({"model": name, "kind": "prefill", "format": f, "batch": 1, "context": n, **r})
            log(f"   prefill {f} N{n}: {r}")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return info, rows


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="v2-lite, smollm2-mla, tiny (default v2-lite,smollm2-mla)")
    ap.add_argument("--formats", default="hf,bf16,c8r8,c4r4,c2r4")
    ap.add_argument("--batches", help="default 1,8,32")
    ap.add_argument("--contexts", help="decode contexts, default 4096,32768,131072")
    ap.add_argument("--prefill-contexts", help="prompt lengths timed at batch 1, default 4096,32768")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill in forwards of this many tokens, each "
                    "timed (a serving engine's chunked prefill); default one forward")
    ap.add_argument("--steps", type=int, help="timed decode steps (median), default 16")
    ap.add_argument("--warmup", type=int, help="untimed decode steps first, default 3")
    ap.add_argument("--budget-gib", type=float, help="cache budget for the largest batch, default 40")
    ap.add_argument("--budget-context", type=int, help="tokens per sequence for the budget, default 131072")
    ap.add_argument("--hf-max-tokens", type=int, default=32 * 32768, help="largest batch x context for `hf` decode")
    ap.add_argument("--graph", action="store_true", help="also time each decode shape with the step captured in a "
                    "CUDA graph (quantmla.cache.graph; our cache formats, --device cuda)")
    # the check runs the same BF16 model twice, fast kernels vs the fp32 torch attention: on the random-weight
    # V2-Lite (27 layers) even the BF16 cache's kernels differ by 3.9-4.1% in logits (H200, 2026-12-01, top-1 all
    # equal), so the gate is 10% and top-1 >= 0.9; a broken kernel gives errors of order 1
    ap.add_argument("--check-tol", type=float, default=0.1,
                    help="largest relative L2 error of the checked logits (default %(default)s)")
    ap.add_argument("--check-top1", type=float, default=0.9,
                    help="smallest top-1 agreement of the checked logits (default %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, small shapes, seconds")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--force", action="store_true", help="overwrite existing results with this tag")
    args = ap.parse_args(argv)
    if args.graph and args.device != "cuda":
        raise SystemExit(f"error: --graph captures the decode step in a CUDA graph: it needs --device cuda, got "
                         f"--device {args.device}")  # fmt: skip
    for k, v in (TINY if args.tiny else DEFAULTS).items():  # what the command line leaves out
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    args.batches, args.contexts = _ints(args.batches), _ints(args.contexts)
    args.prefill_contexts = _ints(args.prefill_contexts)
    tag = args.tag or ("tiny" if args.tiny else (gpu_tag() if args.device == "cuda" else "cpu"))
    target = os.path.join(args.out, f"generate_{tag}.json")
    if os.path.exists(target) and not args.force:
        raise SystemExit(f"error: {target} exists; pass --force to replace it or --tag to write another")
    commit = os.environ.get("QUANTMLA_COMMIT", "")  # the GPU machine gets a copy of the tree without .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        except OSError:
            commit = ""
    import transformers

    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit.strip() or
            "unknown", "command": " ".join(["python", "benchmarks/bench_generate.py",
                                            *(sys.argv[1:] if argv is None else argv)]),
            "torch": torch.__version__, "transformers": transformers.__version__, "policy": vars(POLICY)}  # fmt: skip
    torch.manual_seed(0)
    models, rows = [], []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            mrows: list[dict] = []
            try:
                info, _ = run_model(name, args, args.device, mrows)
            except Stopped as e:  # keep what was measured; the caller's time limit ran out
                meta["partial"] = f"stopped by {e} during {name}"
                log(f"== {name}: {meta['partial']}; writing the {len(mrows)} rows measured")
                models.append({"model": name, "description": f"partial ({meta['partial']})", "params": 0,
                               "dtype": "-"})  # fmt: skip
                rows.extend(mrows)
                break
            except Exception as e:  # one model failing to load (e.g. no converted SmolLM2 here) must not lose others
                log(f"== {name}: failed: {type(e).__name__}: {e}")
                models.append({"model": name, "description": f"failed: {type(e).__name__}: {e}", "params": 0,
                               "dtype": "-"})  # fmt: skip
                rows.extend(mrows)
                continue
            models.append(info)
            rows.extend(mrows)
    finally:
        signal.signal(signal.SIGTERM, previous)
    paths = write_outputs(args.out, tag, meta, models, rows)
    log("wrote " + ", ".join(paths))
    failed = sum(1 for r in rows if r["kind"] == "check" and not r["ok"])
    summary = {"tag": tag, "rows": len(rows), "failed_checks": failed, "partial": meta.get("partial", False)}
    for r in rows:
        if r["kind"] == "budget" and r["format"] in ("c4r4", "c2r4"):
            ref = next((x["max_batch"] for x in rows if x["kind"] == "budget" and x["format"] == "bf16"
                        and x["model"] == r["model"]), 0)  # fmt: skip
            summary[f"{r['model']}_{r['format']}_budget_vs_bf16"] = r["max_batch"] / ref if ref else None
    print(json.dumps(summary))
    return 1 if summary["failed_checks"] or summary["partial"] else 0


if __name__ == "__main__":
    sys.exit(main())
