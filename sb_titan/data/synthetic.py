"""Bundled synthetic long-context corpus (no downloads).

Document lengths follow `longtail-v1`; every document embeds long-range tasks
(key-value facts recalled at the end, and sometimes a passkey), so which key blocks
sparse attention keeps matters for the loss. Documents are generated on demand from
(seed, sample id), so planning needs only the length array and nothing is stored.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import cached_property

import numpy as np

from sb_titan.data.longtail import longtail_v1
from sb_titan.data.tokenizer import BOS, TOKENIZER_DIR, load_tokenizer

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u"]
WORDS = [a + v + b + w for a, v, b, w in itertools.product(_ONSETS, _VOWELS, _ONSETS[:6], "ao")]
FACT_EVERY = 256  # one key-value fact per this many tokens
MIN_FACT_LEN = 48  # documents shorter than this are plain filler


def training_text() -> Iterator[str]:
    """Text the tokenizer is trained on: the corpus vocabulary and task phrases."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        words = rng.choice(WORDS, 64)
        yield " ".join(words)
        a, b = rng.integers(0, 10000, 2)
        yield f" key {a} maps to {b} . recall key {a} : {b} . the passkey is {a}{b} ."


class SyntheticCorpus:
    """`num_docs` documents with longtail-v1 lengths at row length `row_len`."""

    def __init__(
        self, num_docs: int, row_len: int, seed: int = 0, tokenizer_path: str = str(TOKENIZER_DIR)
    ) -> None:
        self.name = f"synthetic-longtail-v1(n={num_docs}, R={row_len}, seed={seed})"
        self.seed = seed
        self._lengths = longtail_v1(num_docs, row_len, seed)
        self.tokenizer = load_tokenizer(tokenizer_path)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def max_token_id(self) -> int:
        return self.tokenizer.get_vocab_size() - 1

    @cached_property
    def _word_ids(self) -> list[np.ndarray]:
        return [np.array(self._encode(" " + w)) for w in WORDS]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _filler(self, rng: np.random.Generator, n: int) -> np.ndarray:
        out: list[np.ndarray] = []
        have = 0
        while have < n:
            ids = rng.integers(0, len(WORDS), max(8, n // 2))
            chunk = np.concatenate([self._word_ids[i] for i in ids])
            out.append(chunk)
            have += len(chunk)
        return np.concatenate(out)[:n]

    def document(self, sample_id: int) -> np.ndarray:
        """All tokens of one document (deterministic in seed and id)."""
        n = int(self._lengths[sample_id])
        rng = np.random.default_rng([self.seed, sample_id])
        bos = self.tokenizer.token_to_id(BOS)
        if n < MIN_FACT_LEN:
            return np.concatenate([[bos], self._filler(rng, n - 1)]).astype(np.int64)
        n_facts = max(1, n // FACT_EVERY)
        keys = rng.choice(10000, n_facts, replace=False)
        values = rng.integers(0, 10000, n_facts)
        facts = [self._encode(f" key {k} maps to {v} .") for k, v in zip(keys, values, strict=True)]
        asked = rng.choice(n_facts, min(n_facts, 2), replace=False)
        query = [t for i in asked for t in self._encode(f" recall key {keys[i]} : {values[i]} .")]
        body_len = n - 1 - len(query)
        fact_len = sum(map(len, facts))
        if body_len < fact_len:  # too short for all facts: keep just the queried ones
            facts = [facts[i] for i in asked]
            fact_len = sum(map(len, facts))
        filler = self._filler(rng, max(0, body_len - fact_len))
        cuts = np.sort(rng.integers(0, len(filler) + 1, len(facts)))
        parts, prev = [np.array([bos])], 0
        for cut, fact in zip(cuts, facts, strict=True):
            parts += [filler[prev:cut], np.array(fact)]
            prev = cut
        parts += [filler[prev:], np.array(query)]
        doc = np.concatenate(parts).astype(np.int64)
        return doc[:n] if len(doc) >= n else np.concatenate([doc, self._filler(rng, n - len(doc))])

    def read(self, sample_id: int, start: int, length: int) -> np.ndarray:
        return self.document(sample_id)[start : start + length]
