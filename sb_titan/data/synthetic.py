"""Bundled synthetic long-context corpus (no downloads).

Document lengths follow `longtail-v1`; every document embeds long-range tasks
(key-value facts recalled at the end, and sometimes a passkey), so which key blocks
sparse attention keeps matters for the loss. Documents are generated on demand from
(seed, sample id), so planning needs only the length array and nothing is stored.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sb_titan.data.longtail import longtail_v1
from sb_titan.data.tokenizer import BOS, TOKENIZER_DIR, load_tokenizer

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u"]
WORDS = [a + v + b + w for a, v, b, w in itertools.product(_ONSETS, _VOWELS, _ONSETS[:6], "ao")]
FACT_EVERY = 256  # one key-value fact per this many tokens
# A fact is phrased as its recall is (" recall key K : V ."), so recalling it is copying
# what followed the same key earlier: with " key K maps to V ." the key sits 3 tokens
# before the value in the fact but 1 in the query, and the debug4 base took ~2x the
# steps to start matching keys (docs/eval.md, "Pilot").
FACT = " key {key} : {value} ."
QUERY = " recall key {key} :"
MIN_FACT_LEN = 48  # documents shorter than this are plain filler


def training_text() -> Iterator[str]:
    """Text the tokenizer is trained on: the corpus vocabulary and task phrases (the
    phrasing of the bundled tokenizer's build; it tokenises FACT the same way)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        words = rng.choice(WORDS, 64)
        yield " ".join(words)
        a, b = rng.integers(0, 10000, 2)
        yield f" key {a} maps to {b} . recall key {a} : {b} . the passkey is {a}{b} ."


@dataclass(frozen=True)
class Recall:
    """One recall task of a document: the fact " key K : V ." starts at token
    `fact_at`; the recalled value's `value_len` tokens start at `value_at`."""

    fact_at: int
    value_at: int
    value_len: int

    @property
    def distance(self) -> int:
        return self.value_at - self.fact_at


class SyntheticCorpus:
    """`num_docs` documents with longtail-v1 lengths at row length `row_len`, or with the
    given `lengths` (held-out evaluation documents of chosen sizes)."""

    def __init__(
        self,
        num_docs: int,
        row_len: int,
        seed: int = 0,
        tokenizer_path: str = str(TOKENIZER_DIR),
        lengths: np.ndarray | None = None,
        fact_every: int = FACT_EVERY,
        recalls: int = 2,
    ) -> None:
        if fact_every < 1 or recalls < 1:
            raise ValueError(
                f"synthetic corpus: fact_every ({fact_every}) and recalls ({recalls}) must be >= 1"
            )
        mix = (
            "" if (fact_every, recalls) == (FACT_EVERY, 2) else f", facts/{fact_every}, r={recalls}"
        )
        shape = "longtail-v1" if lengths is None else "given-lengths"
        if lengths is not None and len(set(lengths.tolist())) == 1:
            shape = f"fixed-{int(lengths[0])}"
        self.name = f"synthetic-{shape}(n={num_docs}, R={row_len}, seed={seed}{mix})"
        self.seed = seed
        self.fact_every = fact_every
        self.recalls = recalls
        self._lengths = longtail_v1(num_docs, row_len, seed) if lengths is None else lengths
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
        if n <= 0:  # a recall-dense document can be all facts and queries
            return np.zeros(0, dtype=np.int64)
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
        return self._generate(sample_id)[0]

    def annotated(self, sample_id: int) -> tuple[np.ndarray, list[Recall]]:
        """One document and where its recall tasks sit (for scoring held-out recall)."""
        doc, asked = self._generate(sample_id)
        tasks = []
        for fact_at, query_end, value in asked:
            value_len = len(self._encode(f" {value}"))
            value_at = query_end - value_len - 1  # the value, then " ."
            if value_at + value_len <= len(doc):  # not cut off by the document's end
                tasks.append(Recall(fact_at, value_at, value_len))
        return doc, tasks

    def _generate(self, sample_id: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """The document, and (fact start, query end, value) of each recall it asks; the
        value's tokens are left to `annotated`, off the loader's path."""
        n = int(self._lengths[sample_id])
        rng = np.random.default_rng([self.seed, sample_id])
        bos = self.tokenizer.token_to_id(BOS)
        if n < MIN_FACT_LEN:
            return np.concatenate([[bos], self._filler(rng, n - 1)]).astype(np.int64), []
        n_facts = max(1, n // self.fact_every)
        keys = rng.choice(10000, n_facts, replace=False)
        values = rng.integers(0, 10000, n_facts)
        facts = [
            self._encode(FACT.format(key=k, value=v)) for k, v in zip(keys, values, strict=True)
        ]
        asked = rng.choice(n_facts, min(n_facts, self.recalls), replace=False)
        queries = [self._encode(QUERY.format(key=keys[i]) + f" {values[i]} .") for i in asked]
        body_len = n - 1 - sum(map(len, queries))
        kept = list(range(n_facts))
        if body_len < sum(map(len, facts)):  # too short for all facts: keep just the queried ones
            kept = [int(i) for i in asked]
        filler = self._filler(rng, max(0, body_len - sum(len(facts[i]) for i in kept)))
        cuts = np.sort(rng.integers(0, len(filler) + 1, len(kept)))
        parts, prev, offset, fact_at = [np.array([bos])], 0, 1, {}
        for cut, i in zip(cuts, kept, strict=True):
            offset += int(cut) - prev
            fact_at[i] = offset
            parts += [filler[prev:cut], np.array(facts[i])]
            offset += len(facts[i])
            prev = int(cut)
        offset += len(filler) - prev
        parts.append(filler[prev:])
        recalls = []
        for i, query in zip(asked, queries, strict=True):
            offset += len(query)
            recalls.append((fact_at[int(i)], offset, int(values[i])))
            parts.append(np.array(query))
        doc = np.concatenate(parts).astype(np.int64)
        if len(doc) < n:
            doc = np.concatenate([doc, self._filler(rng, n - len(doc))])
        return doc[:n], recalls

    def read(self, sample_id: int, start: int, length: int) -> np.ndarray:
        return self.document(sample_id)[start : start + length]
