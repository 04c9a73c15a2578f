"""The Triton decode kernels' split-K count (``triton_decode.default_num_splits``): the rounding to whole waves of
resident programs changes only calls that fill more than one wave, never adds splits, and picks at the H200's batch-32
BF16 shapes the count measured fastest there (decode_vs_flashmla_h200_bf16_splits.md: 8 splits, 1154 us vs 1381 at
128K, 310 vs 322 at 32K; 12 and 17 splits, which leave a last wave partly empty, were the slowest counts there)."""

from __future__ import annotations

import math

import pytest
import torch

from quantmla.kernels.triton_decode import TUNING, TUNING_BF16, default_num_splits

CPU = torch.device("cpu")
H200_SMS = 132
SHAPES = [(b, n) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for n in (512, 4096, 32768, 131072, 1 << 20)]


def _first_choice(batch: int, pages: int, sms: int) -> int:
    return default_num_splits(batch, pages, CPU, dict(TUNING_BF16, resident=None), sms=sms)


@pytest.mark.parametrize("sms", [8, H200_SMS])
def test_rounding_touches_only_calls_past_one_wave_and_never_adds_splits(sms):
    slots = TUNING_BF16["resident"] * sms
    changed = 0
    for b, n in SHAPES:
        pages = math.ceil(n / 64)
        first, got = _first_choice(b, pages, sms), default_num_splits(b, pages, CPU, TUNING_BF16, sms=sms)
        assert 1 <= got <= first
        if b * first <= slots:
            assert got == first, (b, n)  # one wave or less: nothing to round
        elif got != first:
            changed += 1
            waves = [math.ceil(b * s / slots) for s in (got, first)]
            per_split = [math.ceil(pages / s) for s in (got, first)]
            assert waves[0] * per_split[0] < waves[1] * per_split[1], (b, n)  # fewer page-steps in all
    assert changed or sms != H200_SMS  # at 132 SMs the grid has calls whose last wave runs nearly empty


def test_h200_batch32_bf16_takes_the_measured_split_count():
    for n in (32768, 131072):
        assert _first_choice(32, n // 64, H200_SMS) == 17  # what the old rule gave: 2.06 waves of 264 programs
        assert default_num_splits(32, n // 64, CPU, TUNING_BF16, sms=H200_SMS) == 8


def test_packed_kernel_settings_are_not_rounded():
    for b, n in SHAPES:
        pages = math.ceil(n / 64)
        assert default_num_splits(b, pages, CPU, TUNING, sms=H200_SMS) == _first_choice(b, pages, H200_SMS)


def test_ragged_bf16_batches_get_the_plan_for_their_own_lengths():
    """The BF16 kernel (resident programs known) plans a ragged batch for its lengths, as the CUDA kernels do
    (split_plan.split_plan); equal lengths, a plan set for a capacity, and the packed kernel keep
    default_num_splits' measured count."""
    from types import SimpleNamespace

    from quantmla.kernels.split_plan import split_plan
    from quantmla.kernels.triton_decode import plan_num_splits
    from quantmla.quant.formats import get_format

    def cache(name, lens, planned=None):  # what the planner reads of a PagedMLACache (plan_lengths: test_paged.py)
        return SimpleNamespace(fmt=get_format(name), batch=len(lens), layout=SimpleNamespace(page_size=64),
                               plan_lengths=lambda: [planned] * len(lens) if planned else list(lens))  # fmt: skip

    ragged = [4096 * (i + 1) for i in range(8)] * 4  # 32 sequences of 4K..32K: 64..512 pages
    pages = tuple(sorted(math.ceil(n / 64) for n in ragged))
    bf16 = cache("bf16", ragged)
    got = plan_num_splits(bf16, 512, CPU, TUNING_BF16, sms=H200_SMS)
    assert got == split_plan(pages, 1, TUNING_BF16["resident"] * H200_SMS)
    assert got > default_num_splits(32, 512, CPU, TUNING_BF16, sms=H200_SMS)  # the longest sequences split further
    captured = cache("bf16", ragged, planned=32768)  # a captured step: every sequence at the capacity
    assert plan_num_splits(captured, 512, CPU, TUNING_BF16, sms=H200_SMS) == 8
    equal = cache("bf16", [32768] * 32)
    assert plan_num_splits(equal, 512, CPU, TUNING_BF16, sms=H200_SMS) == 8  # the measured count, unchanged
    packed = cache("c4r4", ragged)
    assert plan_num_splits(packed, 512, CPU, TUNING, sms=H200_SMS) == default_num_splits(32, 512, CPU, TUNING,
                                                                                          sms=H200_SMS)  # fmt: skip
