"""RULER's needle-in-a-haystack prompts (Hsieh et al. 2024; NVIDIA/RULER, niah.py).

The eight standard NIAH configs (scripts/synthetic.yaml) with RULER's needle, question,
needle counts, depths and 128 generated tokens. Two phrasings:

- `ruler`: RULER's English template ("One of the special magic numbers for {key} is:
  {value}.", its question and answer prefix, the singular rewording when one value is
  asked), keys adjective-noun words, values 7-digit numbers or UUIDs, as RULER draws
  them; for real (e.g. Qwen2.5) tokenizers.
- `corpus`: the bundled synthetic corpus's own phrasing, so the tiny models trained on
  it can be scored: needle " key K : V .", question " recall key K :", keys
  0-9999 and values 1000-9999 (4 digits, so substring scoring cannot find a shorter
  number inside a longer one); every key/value type is a number here (the corpus has no
  words or UUIDs), so niah_single_2/3 and niah_multikey_2/3 differ only in their draws.
  The corpus never repeats a key or asks several at once, so: multivalue asks
  " recall key K :" once and scores the output (32 tokens) for all four values (a model
  that only learnt the corpus gets ~25); multiquery asks the keys one after another as
  the corpus's two-query endings do (" recall key K1 : <its answer> . recall key K2 :"),
  each answer greedy and cut at " .", the answers joined for scoring.

Haystacks (RULER's three kinds): `noise` = one fixed line repeated (RULER's "The grass
is green..."; corpus: a fixed 12-word phrase), `essay` = RULER's Paul Graham essays,
here the corpus's filler words (random, each word its own sentence) or `--haystack FILE`
(cycled; sentences end at . ! ?), `needle` = distractor needles with other keys. Needles
go at sentence starts at depths drawn without replacement from RULER's 40 evenly spaced
depths (essay), or before uniformly drawn lines (noise, needle). A prompt has the most
haystack units such that prompt + generated tokens <= the target length, as RULER's
search does: it is at most the target, and one more unit would exceed it.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sb_titan.data.synthetic import FACT, QUERY, WORDS


class RulerInputError(ValueError):
    """Bad user input (names the flag); the CLI prints it as one line."""


@dataclass(frozen=True)
class NiahTask:
    """One of RULER's niah configs (scripts/synthetic.yaml)."""

    haystack: str  # noise | essay | needle
    key_type: str  # words | numbers | uuids
    value_type: str
    num_keys: int = 1  # needles with distinct keys (RULER: max(num_needle_k, num_needle_q))
    num_values: int = 1  # values per key, all to be retrieved
    num_queries: int = 1  # keys asked


TASKS: dict[str, NiahTask] = {
    "niah_single_1": NiahTask("noise", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahTask("needle", "words", "numbers"),
    "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", num_keys=4, num_queries=4),
}
TEMPLATES = ("corpus", "ruler")
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]
TOKENS_TO_GENERATE = 128  # RULER constants.py, niah
CORPUS_TOKENS_PER_ANSWER = 8  # " 1234 ." is 4 bundled tokens; RULER's 128 is a sentence

RULER_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
RULER_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
RULER_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
    "all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
RULER_ANSWER_PREFIX = (
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))
"""niah.py's rewording when one value is asked (applied in this order)."""
CORPUS_NOISE = " ".join(WORDS[(131 * i) % len(WORDS)] for i in range(12))

WORDS_FILE = Path(__file__).resolve().parent.parent / "assets" / "ruler_words.json"


@functools.cache
def key_words() -> tuple[list[str], list[str]]:
    """Adjectives and nouns of the "words" keys (RULER: adjective-noun pairs)."""
    words = json.loads(WORDS_FILE.read_text())
    return words["adjectives"], words["nouns"]


def parse_tasks(text: str | None) -> tuple[str, ...]:
    names = [t.strip() for t in (text or "all").split(",") if t.strip()]
    tasks = tuple(dict.fromkeys(t for n in names for t in (TASKS if n == "all" else (n,))))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise RulerInputError(f"--tasks: unknown task(s) {unknown}; expected all or {tuple(TASKS)}")
    return tasks


@dataclass
class NiahSample:
    ids: list[int]  # prompt tokens, through the (first) question
    references: list[str]  # RULER's `outputs`: every value to retrieve
    needles: list[tuple[str, str]]  # (key, value) in document order
    queries: list[str]  # keys asked, in order
    depths: list[float]  # each needle's depth in % of the haystack, document order
    needle_at: list[int]  # haystack unit each needle precedes (n_units: at the end)
    n_units: int  # haystack units (words or lines) in the prompt
    max_new_tokens: int  # per generation
    followups: list[list[int]] = field(default_factory=list)
    """Corpus multiquery: tokens appended after answer i (" . recall key K :")."""
    stop_ids: list[int] = field(default_factory=list)  # besides EOS (chained answers)


class _Units:
    """A lazily extended, deterministic stream of haystack units (words or lines)."""

    def __init__(self, stream: Iterator[str]) -> None:
        self._stream, self._buf = stream, []

    def take(self, n: int) -> list[str]:
        self._buf.extend(itertools.islice(self._stream, max(0, n - len(self._buf))))
        return self._buf[:n]


def read_haystack(path: str | Path) -> list[str]:
    """Words of a user's text file (RULER: whitespace collapsed, split on spaces)."""
    path = Path(path)
    if not path.is_file():
        raise RulerInputError(f"--haystack: {path} not found (expected a UTF-8 text file)")
    words = re.sub(r"\s+", " ", path.read_text(encoding="utf-8")).split()
    if not words:
        raise RulerInputError(f"--haystack: {path} has no words (expected a UTF-8 text file)")
    return words


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclass
class _Draw:
    """A sample's random choices, made before the haystack is sized."""

    pairs: list[tuple[str, str]]  # needles' (key, value), shuffled: document order
    place: list[float]  # their depths in %, sorted
    queries: list[str]
    refs: list[str]
    keys_taken: set[str]
    values_taken: set[str]


class NiahBuilder:
    """Builds NIAH prompts of a target token length for one tokenizer and template."""

    def __init__(
        self,
        tokenizer,
        template: str = "corpus",
        bos_id: int | None = None,
        haystack_words: list[str] | None = None,
    ) -> None:
        if template not in TEMPLATES:
            raise RulerInputError(f"--template: {template!r}; expected one of {TEMPLATES}")
        self.tokenizer, self.template, self.bos_id = tokenizer, template, bos_id
        self.haystack_words = haystack_words  # None: the corpus's filler words
        self._dot = self._enc(" .")  # ends a corpus answer; a stop token if it is one token
        self._stop = self._dot if len(self._dot) == 1 else []

    def _enc(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    # --- needles -------------------------------------------------------------------
    def _random(self, kind: str, rng: np.random.Generator, role: str) -> str:
        if self.template == "corpus":
            return str(int(rng.integers(10000) if role == "key" else rng.integers(1000, 10000)))
        if kind == "words":
            adjectives, nouns = key_words()
            return f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"
        if kind == "numbers":
            return str(int(rng.integers(10**6, 10**7)))  # RULER: 7 digits
        return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))

    def _unique(self, kind: str, rng, role: str, taken: set[str]) -> str:
        for _ in range(1000):
            x = self._random(kind, rng, role)
            if x not in taken:
                taken.add(x)
                return x
        raise RulerInputError(
            f"--lengths: too long for the {self.template} template's distinct {role}s "
            f"({len(taken)} used); use shorter lengths"
        )

    def needle(self, key: str, value: str, task: NiahTask) -> str:
        if self.template == "corpus":
            return FACT.format(key=key, value=value).strip()
        return RULER_NEEDLE.format(type_needle_v=task.value_type, key=key, value=value)

    def _draw(self, task: NiahTask, rng: np.random.Generator) -> _Draw:
        keys_taken: set[str] = set()
        values_taken: set[str] = set()
        keys = [self._unique(task.key_type, rng, "key", keys_taken) for _ in range(task.num_keys)]

        def value() -> str:
            return self._unique(task.value_type, rng, "value", values_taken)

        values = [[value() for _ in range(task.num_values)] for _ in keys]
        pairs = [(k, v) for k, vs in zip(keys, values, strict=True) for v in vs]
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]  # RULER shuffles the needles
        if task.haystack == "essay":
            place = sorted(float(d) for d in rng.choice(DEPTHS, len(pairs), replace=False))
        else:
            place = sorted(float(f) * 100 for f in rng.random(len(pairs)))
        asked = [int(i) for i in rng.choice(task.num_keys, task.num_queries, replace=False)]
        queries = [keys[i] for i in asked]
        refs = [v for i in asked for v in values[i]]
        return _Draw(pairs, place, queries, refs, keys_taken, values_taken)

    # --- haystack ------------------------------------------------------------------
    def _units(self, task: NiahTask, rng, draw: _Draw) -> _Units:
        if task.haystack == "noise":
            noise = CORPUS_NOISE if self.template == "corpus" else RULER_NOISE
            return _Units(itertools.repeat(noise))
        if task.haystack == "needle":

            def distractors() -> Iterator[str]:
                while True:
                    key = self._unique(task.key_type, rng, "key", draw.keys_taken)
                    value = self._random(task.value_type, rng, "value")
                    if value not in draw.values_taken:
                        yield self.needle(key, value, task)

            return _Units(distractors())
        if self.haystack_words is not None:
            return _Units(itertools.cycle(self.haystack_words))
        return _Units(_random_words(rng))

    def _sentence_starts(self, words: list[str]) -> list[int]:
        if self.haystack_words is None:  # corpus filler: every word is its own sentence
            return list(range(max(1, len(words))))
        return [0] + [i + 1 for i, w in enumerate(words[:-1]) if _SENTENCE_END.search(w)]

    def _insert_at(self, task: NiahTask, units: list[str], place: list[float]) -> list[int]:
        """The unit index each needle goes before (len(units): at the end)."""
        n = len(units)
        if task.haystack == "essay":  # RULER: before sentence int(n_sents * depth / 100)
            starts = self._sentence_starts(units)
            picks = [int(len(starts) * d / 100) for d in place]
            return [starts[i] if i < len(starts) else n for i in picks]
        return [min(int(f / 100 * n), max(n - 1, 0)) for f in place]  # before a random line

    def _context(self, task: NiahTask, units: list[str], needles: list[str], at: list[int]):
        parts, prev = [], 0
        for pos, needle in zip(at, needles, strict=True):
            parts += [*units[prev:pos], needle]
            prev = pos
        parts += units[prev:]
        return ("\n" if self.template == "ruler" and task.haystack != "essay" else " ").join(parts)

    # --- prompt --------------------------------------------------------------------
    def _text(self, task: NiahTask, context: str, queries: list[str]) -> str:
        if self.template == "corpus":
            return f" {context}" + QUERY.format(key=queries[0])
        template = RULER_TEMPLATE + RULER_ANSWER_PREFIX
        type_v = task.value_type
        if task.num_queries * task.num_values == 1:  # RULER's singular wording, verbatim
            for old, new in SINGULAR:
                template = template.replace(old, new)
            type_v = type_v[:-1]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return template.format(type_needle_v=type_v, context=context, query=query)

    def _generation(self, task: NiahTask, draw: _Draw) -> tuple[int, list[list[int]]]:
        """Tokens per generation, and the corpus's chained follow-up questions."""
        if self.template == "ruler":
            return TOKENS_TO_GENERATE, []
        if len(draw.queries) == 1:
            return CORPUS_TOKENS_PER_ANSWER * len(draw.refs), []
        follow = [self._dot + self._enc(QUERY.format(key=k)) for k in draw.queries[1:]]
        return CORPUS_TOKENS_PER_ANSWER, follow

    def build(self, name: str, length: int, seed: np.random.SeedSequence) -> NiahSample:
        """One sample of task `name` whose prompt + generated tokens fit in `length`."""
        task = TASKS[name]
        rng, hay_rng = (np.random.default_rng(s) for s in seed.spawn(2))
        draw = self._draw(task, rng)
        needles = [self.needle(k, v, task) for k, v in draw.pairs]
        units = self._units(task, hay_rng, draw)
        max_new, followups = self._generation(task, draw)
        reserve = max_new * (len(followups) + 1) + sum(map(len, followups))
        cache: dict[int, list[int]] = {}

        def ids_for(n: int) -> list[int]:
            if n not in cache:
                words = units.take(n)
                at = self._insert_at(task, words, draw.place)
                context = self._context(task, words, needles, at)
                text = self._text(task, context, draw.queries)
                cache[n] = ([] if self.bos_id is None else [self.bos_id]) + self._enc(text)
            return cache[n]

        def fits(n: int) -> bool:
            return len(ids_for(n)) + reserve <= length

        if not fits(0):
            raise RulerInputError(
                f"--lengths: {length} is too short for {name} with the {self.template} template "
                f"(needles, question and {reserve} generated tokens take "
                f"{len(ids_for(0)) + reserve})"
            )
        per_unit = max(1.0, len(self._enc(" ".join(units.take(32)))) / 32)
        n = _largest(fits, int((length - reserve - len(ids_for(0))) / per_unit))
        return NiahSample(
            ids=ids_for(n),
            references=draw.refs,
            needles=draw.pairs,
            queries=draw.queries,
            depths=draw.place,
            needle_at=self._insert_at(task, units.take(n), draw.place),
            n_units=n,
            max_new_tokens=max_new,
            followups=followups,
            stop_ids=self._stop if followups else [],
        )


def _random_words(rng: np.random.Generator) -> Iterator[str]:
    while True:
        yield from (WORDS[i] for i in rng.integers(len(WORDS), size=256))


def _largest(fits: Callable[[int], bool], guess: int) -> int:
    """The largest n >= 0 with fits(n), for fits monotone and fits(0) true: gallop from
    `guess`, then bisect (a few tokenizations when the guess is close)."""
    guess = max(0, guess)
    if fits(guess):
        lo, step = guess, 1
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = guess, 1
        while not fits(max(0, hi - step)):
            hi, step = max(0, hi - step), step * 2
        lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
