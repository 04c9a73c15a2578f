"""Slot accounting, the per-request state table and the throughput model, against hand computations."""

from __future__ import annotations

import json

import pytest
import torch

from quantmla.serve.request_state import RequestStateTable
from quantmla.serve.slots import ServeGeometry, format_of_cache_dtype
from quantmla.serve.throughput import StepCosts, job_time, placeholder_costs


@pytest.mark.parametrize(("fmt", "page"), [("bf16", 73728), ("c8r8", 37504), ("c4r4", 19712), ("c2r4", 11520),
                                          ("c4r4t", 64 * (256 + 32 + 8)), ("c2r4t", 64 * (128 + 32 + 8))])
def test_block_bytes_are_the_documented_pages(fmt, page):
    # docs/kernels.md's table: page bytes of a 64-token page, DeepSeek shapes
    assert ServeGeometry(fmt, 27).block_bytes() == page


def test_usable_slots_by_hand():
    budget = 10_280 * 73_728 * 27  # the paper's BF16 row: 657,856 usable slots + vLLM's null block
    assert ServeGeometry("bf16", 27).usable_slots(budget, 128) == 657_856
    state = (4 + 128) * 1152 * 27  # BF16 copies of sink + local, all layers
    assert ServeGeometry("c4r4", 27).state_bytes_per_request() == state
    blocks = (budget - 128 * state) // (19_712 * 27)
    assert ServeGeometry("c4r4", 27).usable_slots(budget, 128) == (blocks - 1) * 64
    with pytest.raises(ValueError, match="max_num_seqs"):
        ServeGeometry("c4r4", 27).num_blocks(10 * state, 11)


def test_cache_dtype_names():
    assert format_of_cache_dtype("quantmla_c2r4") == "c2r4"
    assert format_of_cache_dtype("quantmla_c4r4t") == "c4r4t"
    with pytest.raises(ValueError, match="quantmla_c4r4"):
        format_of_cache_dtype("fp8")


def test_state_table_rows_follow_the_batch():
    t = RequestStateTable(2, 4, 1, 2, 3)
    t.arrange(["a", "b"])
    t.sink[:, 0] = 1.0
    t.sink[:, 1] = 2.0
    t.arrange(["c", "b"])  # a is left out of the step, c is new
    assert t.sink[0, 1].eq(2.0).all() and torch.isnan(t.sink[0, 0]).all()
    assert t.sink[1, t.row_of("a")].eq(1.0).all() and t.row_of("a") >= 2
    t.finish(["a"])
    assert "a" not in t.live()
    t.arrange(["d", "e", "b"])
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        t.arrange(["f", "g"])
    with pytest.raises(RuntimeError, match="arrange"):
        t.batch_views(0, 4)
    assert t.batch_views(1, 2, start=1)[0].data_ptr() == t.sink[1, 1:3].data_ptr()  # prefill rows after a decode
    assert t.nbytes == 2 * 4 * (1 + 2) * 3 * 2


def test_state_table_grows_instead_of_failing_mid_serve():
    """vLLM does not tell workers about preemptions: preempted requests keep rows until recomputed or finished."""
    t = RequestStateTable(1, 2, 1, 2, 3, grow=True)
    t.arrange(["a", "b"])
    t.sink[0, :2] = torch.tensor([1.0, 2.0])[:, None, None]
    t.arrange(["c", "d", "e"])  # a, b preempted (still live), three new requests
    assert t.max_requests >= 5 and t.planned_rows == 2
    assert t.sink[0, t.row_of("a")].eq(1.0).all() and t.sink[0, t.row_of("b")].eq(2.0).all()
    assert all(torch.isnan(t.sink[0, t.row_of(r)]).all() for r in "cde")


def test_job_time_by_hand(tmp_path):
    c = StepCosts("x", "y", step_overhead_s=1.0, per_token_s=0.5, prefill_pair_s=0.25,
                  decode_ctx_token_s={"bf16": 2.0, "c4r4": 1.0})
    trace = [(4, 8, 0, 0), (2, 0, 2, 10)]
    # step 1: 1 + 4 x 0.5 + 8 x 0.25 = 5; step 2: 1 + 2 x 0.5 + 10 x (2 or 1)
    assert job_time(trace, c, "bf16", 4) == (27.0, 4 / 27.0)
    assert job_time(trace, c, "C4R4", 4)[0] == 17.0
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"label": "x"}))
    with pytest.raises(ValueError, match="lacks"):
        StepCosts.from_json(p)
    p.write_text(json.dumps(c.to_dict()))
    assert StepCosts.from_json(p) == c
    assert "PLACEHOLDER" in placeholder_costs().label


def test_format_overrides_by_hand(tmp_path):
    c = StepCosts("x", "y", step_overhead_s=1.0, per_token_s=0.5, prefill_pair_s=0.25,
                  decode_ctx_token_s={"bf16": 2.0, "c4r4": 1.0},
                  format_overrides={"c4r4": {"prefill_pair_s": 0.5, "step_overhead_s": 0.0}})  # fmt: skip
    # bf16: 1 + 4 x 0.5 + 8 x 0.25 = 5; c4r4: 0 + 4 x 0.5 + 8 x 0.5 = 6; then 1 + 1 + 10 x 2 and 0 + 1 + 10 x 1
    assert job_time([(4, 8, 0, 0), (2, 0, 2, 10)], c, "bf16", 4)[0] == 27.0
    assert job_time([(4, 8, 0, 0), (2, 0, 2, 10)], c, "C4R4", 4)[0] == 17.0
    p = tmp_path / "c.json"
    p.write_text(json.dumps(c.to_dict()))
    assert StepCosts.from_json(p) == c
    with pytest.raises(ValueError, match="unknown cost 'decode'"):
        StepCosts("x", "y", 1.0, 0.5, 0.25, {"bf16": 2.0}, {"bf16": {"decode": 1.0}})
    with pytest.raises(ValueError, match=r"\['c4r4'\]\['per_token_s'\] must be >= 0"):
        StepCosts("x", "y", 1.0, 0.5, 0.25, {"bf16": 2.0}, {"c4r4": {"per_token_s": -1.0}})
