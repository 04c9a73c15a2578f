"""Query-aware rounding of the RoPE key: the plan is the optimal error feedback of its moment (float64 algebra),
the codes keep round-to-nearest's scales and offsets, equal its codes when the moment is diagonal, and lower the
moment-weighted error they are for."""

from __future__ import annotations

import pytest
import torch

from quantmla.quant.formats import get_format
from quantmla.quant.quantize import dequantize_codes, quantize_codes
from quantmla.quant.rounding import RopeRounding, fit_rope_rounding, quantize_codes_feedback

ROPE_SPECS = {name: get_format(name).rope for name in ("c4r4", "c8r8", "c2r4")}  # asym 4 / sym 8 / asym 4


def _moment(d: int, seed: int, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, rank or d, generator=g, dtype=torch.float64)
    return a @ a.T


def test_feedback_is_the_optimal_compensation_of_the_channels_left():
    """Row ``order[t]`` of the feedback is ``-(C^-1 b)`` of the damped, normalized moment restricted to the channels
    from ``t`` on (``C`` the rest's block, ``b`` its column): the update that minimizes ``e^T H e`` over them."""
    d, damp = 16, 0.05
    h = _moment(d, 0)
    plan = fit_rope_rounding(h, damp=damp)
    hn = h / h.diagonal().mean() + damp * torch.eye(d, dtype=torch.float64)
    order = plan.order.tolist()
    assert order == torch.sort(hn.diagonal(), descending=True, stable=True).indices.tolist()
    for t in range(d):
        c, rest = order[t], order[t + 1 :]
        row = plan.feedback[c].double()
        done = order[: t + 1]
        assert torch.all(row[done] == 0)  # nothing flows back to rounded channels (nor to c itself)
        if rest:
            want = -torch.linalg.solve(hn[rest][:, rest], hn[rest][:, c])
            torch.testing.assert_close(row[rest], want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", sorted(ROPE_SPECS))
def test_diagonal_moment_rounds_to_nearest_and_scales_never_change(name):
    spec = ROPE_SPECS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 64, generator=g) * torch.linspace(0.1, 5, 64)
    x[3, 5] = float("nan")
    diag = fit_rope_rounding(torch.diag(torch.rand(64, generator=g) + 0.5))
    ref = quantize_codes(x, spec)
    got = quantize_codes_feedback(x, spec, diag)
    assert torch.equal(got[0], ref[0])  # no feedback: round to nearest, channel by channel
    full = quantize_codes_feedback(x, spec, fit_rope_rounding(_moment(64, 2)))
    for a, b in zip(full[1:], ref[1:]):  # scales and offsets: round-to-nearest's own, bit for bit
        assert (a is None and b is None) or torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert not torch.equal(full[0], ref[0])
    assert torch.equal(full[0][3], ref[0][3])  # a NaN token: codes 0 where RTN has 0, nothing fed on


@pytest.mark.parametrize("name", sorted(ROPE_SPECS))
def test_feedback_lowers_the_moment_weighted_error(name):
    """On keys and queries drawn from correlated distributions (float64 scoring), the rounding cuts the mean of
    ``(q . (k_hat - k))^2`` over held-out queries against round-to-nearest with the same bytes."""
    spec, d = ROPE_SPECS[name], 64
    g = torch.Generator().manual_seed(3)
    mix = torch.randn(d, d, generator=g) / d**0.5
    q_train, q_test = torch.randn(4000, d, generator=g) @ mix, torch.randn(4000, d, generator=g) @ mix
    keys = torch.randn(500, d, generator=g) * 2
    plan = fit_rope_rounding(q_train.double().T @ q_train.double())

    def err(codes, scale, offset):
        e = dequantize_codes(codes, scale, offset, spec).double() - keys.double()
        return (q_test.double() @ e.T).pow(2).mean()

    rtn, fed = err(*quantize_codes(keys, spec)), err(*quantize_codes_feedback(keys, spec, plan))
    assert fed < 0.8 * rtn


def test_bad_plans_and_moments_are_refused():
    with pytest.raises(ValueError, match="permutation"):
        RopeRounding(torch.tensor([0, 0]), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="square"):
        fit_rope_rounding(torch.ones(3, 4))
    with pytest.raises(ValueError, match="non-finite"):
        fit_rope_rounding(torch.full((2, 2), float("nan")))
    with pytest.raises(ValueError, match="no positive diagonal"):
        fit_rope_rounding(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="damp"):
        fit_rope_rounding(torch.eye(4), damp=0)
    with pytest.raises(ValueError, match="permutation of the plan's 4"):
        fit_rope_rounding(torch.eye(4)).permuted([0, 1, 1, 2])
    with pytest.raises(ValueError, match="128-channel"):
        quantize_codes_feedback(torch.randn(2, 128), ROPE_SPECS["c4r4"], fit_rope_rounding(torch.eye(64)))


def test_a_permuted_plan_rounds_the_permuted_key_to_the_permuted_codes():
    """``plan.permuted(p)`` on ``x[:, p]`` = ``plan`` on ``x``, codes permuted, bit for bit (fitting a plan to the
    permuted moment instead may differ: the default order breaks diagonal ties by index)."""
    c = _moment(16, 7)
    c = c / torch.outer(c.diagonal().sqrt(), c.diagonal().sqrt())  # a correlation matrix: unit diagonal
    d = torch.arange(1, 9, dtype=torch.float64).repeat(2).sqrt()  # diagonal 1..8 twice: ties between the halves
    h = d[:, None] * c * d[None, :]
    p = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    plan = fit_rope_rounding(h)
    moved = plan.permuted(p)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(2)) * 3
    spec = get_format("c4r4").adapted(64, 16).rope
    want, ws, wo = quantize_codes_feedback(x, spec, plan)
    got, gs, go = quantize_codes_feedback(x[:, p], spec, moved)
    assert torch.equal(got, want[:, p]) and torch.equal(gs, ws) and torch.equal(go, wo)


def test_a_rotated_plan_is_the_plan_of_the_rotated_moment_and_keeps_logits():
    """``fit_rope_rounding(H, rotation=U)`` is the plan of ``U^T H U`` carrying ``U``; ``rotate`` / ``unrotate``
    are ``x U`` / ``x U^T`` (so ``(q U) . (k U) = q . k`` to fp32 rounding); a non-orthogonal or mis-shaped rotation
    is refused; a permuted rotated plan stores the same codes for the permuted key (its rotation takes the
    permutation, the channels it rounds are the same; without that the codes would be a different rounding)."""
    from quantmla.calibrate.query_moments import hadamard_rotation

    d = 16
    h, u = _moment(d, 3), hadamard_rotation(d, seed=5)
    plan = fit_rope_rounding(h, rotation=u)
    want = fit_rope_rounding(u.double().T @ h @ u.double())
    assert torch.equal(plan.order, want.order)
    torch.testing.assert_close(plan.feedback, want.feedback, rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(5, d, generator=g, dtype=torch.float64), torch.randn(7, d, generator=g, dtype=torch.float64)
    ref = q @ k.T
    got = plan.rotate(q.float()).double() @ plan.rotate(k.float()).double().T
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(plan.unrotate(plan.rotate(k.float())), k.float(), rtol=0, atol=1e-5)
    assert torch.equal(fit_rope_rounding(h).rotate(k), k)  # no rotation: the identity, the same tensor
    with pytest.raises(ValueError, match="orthogonal"):
        fit_rope_rounding(h, rotation=2 * u)
    with pytest.raises(ValueError, match="rotation of that shape"):
        fit_rope_rounding(h, rotation=torch.eye(8))
    spec = get_format("c4r4").adapted(64, d).rope
    p = torch.randperm(d, generator=torch.Generator().manual_seed(1))
    x = torch.randn(40, d, generator=g) * 3
    codes, s, o = quantize_codes_feedback(plan.rotate(x), spec, plan)
    moved = plan.permuted(p)
    got_codes, gs, go = quantize_codes_feedback(moved.rotate(x[:, p]), spec, moved)
    # (x[:, p] U[p] sums the same products in another order: equal up to fp32 rounding, so a code may flip where a
    # value sits on a rounding boundary)
    assert (got_codes != codes).float().mean() <= 0.01
    torch.testing.assert_close(gs, s, rtol=1e-3, atol=0)
    torch.testing.assert_close(go, o, rtol=1e-3, atol=1e-3)
