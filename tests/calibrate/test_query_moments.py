"""Query moments and the query-aware RoPE rounding they carry: measured per layer (symmetric, positive
semi-definite, unit mean diagonal, the attention-weighted second moment of the queries that read packed keys),
stored in a transforms file, attached when it is folded, and used by every cache the evaluation builds."""

from __future__ import annotations

import pytest
import torch

from quantmla.cache.hf import rope_rounding_of
from quantmla.calibrate.query_moments import attach_rope_rounding, query_moments
from quantmla.calibrate.shipped import apply_transforms, load_transforms, save_transforms, transforms_tensors
from quantmla.compat import with_cache
from quantmla.eval.runtime import CacheSpec, make_cache, prepare_model
from quantmla.mla.tiny import tiny_model
from quantmla.quant.rounding import RopeRounding


def _tokens(n=3, t=96, seed=1):
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def test_moments_are_the_weighted_query_second_moments():
    model = tiny_model("deepseek_v2", seed=3).eval()
    m = query_moments(model, _tokens(), sink=2, local=16, query_stride=3, batch_size=2)
    assert sorted(m) == [0, 1]
    for h in m.values():
        assert h.shape == (16, 16)
        torch.testing.assert_close(h, h.T)
        assert h.diagonal().mean().item() == pytest.approx(1.0, rel=1e-5)
        assert torch.linalg.eigvalsh(h.double()).min() > -1e-5
        assert (h - torch.diag(h.diagonal())).abs().sum() > 0.05 * h.diagonal().sum()  # not diagonal: worth it
    with pytest.raises(ValueError, match="local"):
        query_moments(model, _tokens(t=16), local=16)


def test_transforms_file_carries_the_rounding_into_every_cache(tmp_path):
    model = prepare_model(tiny_model("deepseek_v2", seed=3))
    assert rope_rounding_of(model) is None
    ids = _tokens(n=1, t=80, seed=2)

    def logits(m):
        cache = make_cache(m, CacheSpec("c4r4", sink=2, local=8))
        with torch.no_grad():
            out = m(ids, **with_cache(cache), use_cache=True).logits
        return out, cache

    rtn, rtn_cache = logits(model)
    assert all(v.rope_rounding is None for v in rtn_cache.store.views)
    moments = query_moments(model, _tokens(), sink=2, local=16)
    path = tmp_path / "t.safetensors"
    tensors = {}
    for i, h in moments.items():
        tensors.update(transforms_tensors(i, None, None, h))
    save_transforms(path, tensors, {"method": "rtn"})
    loaded, _ = load_transforms(path)
    assert loaded["layers.0.rope.query_moment"].dtype == torch.float16
    assert apply_transforms(model, loaded) == 2  # no transforms, only the rounding: the weights are unchanged
    plans = rope_rounding_of(model)
    assert len(plans) == 2 and all(isinstance(p, RopeRounding) for p in plans)
    fed, fed_cache = logits(model)
    assert all(v.rope_rounding is not None for v in fed_cache.store.views)
    assert not torch.equal(fed, rtn)  # other RoPE codes, read back
    exact = model(ids).logits
    assert (fed - exact).abs().max() < 10 * (rtn - exact).abs().max()  # the same grid: no larger scale of error
    bad = {"layers.0.rope.query_moment": torch.eye(8, dtype=torch.float16)}
    with pytest.raises(ValueError, match="query moment"):
        apply_transforms(tiny_model("deepseek_v2", seed=3), bad)
    with pytest.raises(ValueError, match="layer 7"):
        attach_rope_rounding(model, {7: torch.eye(16)})


def test_fused_checkpoint_carries_its_rounding(tmp_path):
    """`quantmla calibrate`'s folder stores the moments beside the weights; loading the folder attaches the plans
    (fitted to the stored fp16 moments), and a folder without them loads with none."""
    from transformers import AutoModelForCausalLM

    from quantmla.calibrate.fuse import make_quant_config, save_fused
    from quantmla.calibrate.query_moments import ROUNDING_FILE, load_saved_rope_rounding
    from quantmla.quant.rounding import fit_rope_rounding

    def load(folder):  # what resolve_model does with a folder (its tokenizer aside)
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        load_saved_rope_rounding(m, folder)
        return m

    model = tiny_model("deepseek_v2", seed=3).eval()
    moments = query_moments(model, _tokens(), sink=2, local=16)
    out = save_fused(model, tmp_path / "fused", make_quant_config("c4r4"), rope_moments=moments)
    assert (out / ROUNDING_FILE).is_file()
    loaded = load(out)
    plans = rope_rounding_of(loaded)
    for i, plan in enumerate(plans):
        want = fit_rope_rounding(moments[i].half().float())
        assert torch.equal(plan.order, want.order) and torch.equal(plan.feedback, want.feedback)
    plain = save_fused(model, tmp_path / "plain", make_quant_config("c4r4"))
    assert rope_rounding_of(load(plain)) is None


def test_post_rope_rotations_travel_in_both_kinds_of_file(tmp_path):
    """A layer's post-RoPE rotation is stored beside its moment (fp32) in a transforms file and in a fused folder's
    rounding file; loading either attaches plans that carry the rotation (fitted to ``U^T H U``); a rotation without
    its moment is refused."""
    from quantmla.calibrate.query_moments import hadamard_rotation, save_rounding_file, saved_rounding_plans
    from quantmla.quant.rounding import fit_rope_rounding

    model = prepare_model(tiny_model("deepseek_v2", seed=3))
    dr = model.config.qk_rope_head_dim
    moments = query_moments(model, _tokens(), sink=2, local=16)
    rots = {i: hadamard_rotation(dr, seed=i) for i in moments}
    tensors = {}
    for i, h in moments.items():
        tensors.update(transforms_tensors(i, None, None, h, post_rotation=rots[i]))
    path = tmp_path / "t.safetensors"
    save_transforms(path, tensors, {"method": "rtn"})
    loaded, _ = load_transforms(path)
    assert loaded["layers.1.rope.post_rotation"].dtype == torch.float32
    apply_transforms(model, loaded)
    for i, plan in enumerate(rope_rounding_of(model)):
        assert torch.equal(plan.rotation, rots[i])
        want = fit_rope_rounding(moments[i].half().float(), rotation=rots[i])
        assert torch.equal(plan.order, want.order) and torch.equal(plan.feedback, want.feedback)
    save_rounding_file(tmp_path, moments, rotations=rots)
    for i, plan in saved_rounding_plans(tmp_path).items():
        assert torch.equal(plan.rotation, rots[i])
    with pytest.raises(ValueError, match="query moment its rounding plan"):
        transforms_tensors(0, None, None, None, post_rotation=rots[0])
    with pytest.raises(ValueError, match="without its query moment"):
        attach_rope_rounding(model, {0: moments[0]}, {1: rots[1]})
