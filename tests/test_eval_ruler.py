"""RULER NIAH: prompt construction, RULER's scoring, the runner's wiring and the CLI."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import sb_titan.eval.ruler as ruler
from sb_titan.data.synthetic import WORDS
from sb_titan.data.tokenizer import load_tokenizer
from sb_titan.eval.generate import GenerationResult
from sb_titan.eval.niah import (
    CORPUS_NOISE,
    DEPTHS,
    RULER_ANSWER_PREFIX,
    RULER_NEEDLE,
    RULER_TEMPLATE,
    TASKS,
    NiahBuilder,
    RulerInputError,
    key_words,
    read_haystack,
)
from sb_titan.eval.ruler import (
    RulerConfig,
    postprocess_pred,
    run_ruler,
    sample_seed,
    string_match_all,
    string_match_part,
)
from sb_titan.tools.eval import main as eval_main

DEBUG_TOML = Path(__file__).resolve().parents[1] / "train_configs" / "debug_cpu.toml"
FACT = re.compile(r"(?<!recall )key (\d+) : (\d+) \.")
RULER_FACT = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


# --- scoring: hand-computed from RULER's constants.py definitions ---------------------


def test_string_match_by_hand():
    preds = ["The special magic numbers are 1234567 and 7654321.", "nothing here", "ABC-Def is 42"]
    refs = [["1234567", "7654321", "1111111", "2222222"], ["5"], ["abc-def", "43"]]
    # all: (2/4 + 0/1 + 1/2) / 3 = 1/3 -> 33.33; part: (1 + 0 + 1) / 3 -> 66.67
    assert string_match_all(preds, refs) == 33.33
    assert string_match_part(preds, refs) == 66.67
    assert string_match_all(["x"], [["X"]]) == 100.0  # case-insensitive
    assert string_match_all(["12345"], [["1234"]]) == 100.0  # substring, as RULER
    assert string_match_all(["a b c"], [["a", "b", "z"]]) == 66.67  # partial credit
    assert string_match_part(["a b c"], [["q", "z"]]) == 0.0
    assert string_match_all(["a", "b"], [["a"], ["c"]]) == 50.0
    assert postprocess_pred(" \tabc\x07def\n") == "abc\ndef"


def test_string_match_matches_the_formula_on_random_cases():
    """Exact rational arithmetic and regex search, against the functions' float code."""
    rng = np.random.default_rng(0)
    alphabet = list("aAbB1 ")
    text = lambda n: "".join(rng.choice(alphabet, n))  # noqa: E731
    for _ in range(200):
        preds = [text(int(rng.integers(0, 12))) for _ in range(int(rng.integers(1, 6)))]
        refs = [
            [text(int(rng.integers(1, 3))) for _ in range(int(rng.integers(1, 5)))] for _ in preds
        ]
        hit = lambda r, p: re.search(re.escape(r), p, re.IGNORECASE) is not None  # noqa: E731
        total_all = sum(
            Fraction(sum(hit(r, p) for r in rs), len(rs)) for p, rs in zip(preds, refs, strict=True)
        )
        total_part = sum(int(any(hit(r, p) for r in rs)) for p, rs in zip(preds, refs, strict=True))
        assert string_match_all(preds, refs) == round(float(total_all / len(preds) * 100), 2)
        assert string_match_part(preds, refs) == round(total_part / len(preds) * 100, 2)


# --- prompts ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _reserve(s) -> int:
    return s.max_new_tokens * (1 + len(s.followups)) + sum(map(len, s.followups))


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("task", list(TASKS))
def test_corpus_prompt(tok, task):
    """Length, the corpus's own tokens, needles at their depths, references = needles."""
    length = 512
    builder = NiahBuilder(tok, "corpus", bos_id=0)
    s = builder.build(task, length, sample_seed(42, task, length, 0))
    assert s.ids == builder.build(task, length, sample_seed(42, task, length, 0)).ids
    spec = TASKS[task]
    # at most the target; one more haystack unit would not fit
    unit = {"essay": 4, "noise": len(_enc(tok, " " + CORPUS_NOISE)), "needle": 12}[spec.haystack]
    assert length - unit < len(s.ids) + _reserve(s) <= length
    text = tok.decode(s.ids)
    assert s.ids[0] == 0 and s.ids[1:] == [t for w in text.split() for t in _enc(tok, " " + w)]
    facts = [(k, v) for k, v in FACT.findall(text)]
    asked = re.search(r" recall key (\d+) :$", text).group(1)
    assert asked == s.queries[0]
    needles = [f for f in facts if f in s.needles]
    assert needles == s.needles and len(s.needles) == spec.num_keys * spec.num_values
    assert len({k for k, _ in facts}) == len(facts) - len(s.needles) + spec.num_keys  # distinct
    if spec.num_queries == 1:
        assert sorted(s.references) == sorted(v for k, v in facts if k == asked)
    else:  # all keys asked, one after another
        assert sorted(s.queries) == sorted(k for k, _ in s.needles)
        later = [tok.decode(f) for f in s.followups]
        assert later == [f" . recall key {k} :" for k in s.queries[1:]]
        assert s.references == [dict(s.needles)[k] for k in s.queries]
    if task == "niah_multivalue":
        assert len({k for k, _ in s.needles}) == 1 and len(set(s.references)) == 4
    if task == "niah_multikey_1":
        assert len({k for k, _ in s.needles}) == 4 and len(s.references) == 1
    assert all(len(v) == 4 for v in s.references)  # no shorter number hides in a longer one
    # depths: essay needles sit before filler word int(n * depth / 100), depth from DEPTHS
    body = text[: text.rindex(" recall key")]
    chunks = re.split(r" ?key \d+ : \d+ \.", body)
    if spec.haystack == "essay":
        assert len(set(s.depths)) == len(s.depths) and set(s.depths) <= set(DEPTHS)
        before = np.cumsum([len(c.split()) for c in chunks[:-1]]).tolist()
        assert before == s.needle_at == [int(s.n_units * d / 100) for d in s.depths]
        assert all(w in WORDS for w in " ".join(chunks).split())
    elif spec.haystack == "noise":
        assert " ".join(chunks).split() == CORPUS_NOISE.split() * s.n_units
    else:  # distractors: other keys, never the asked value
        assert len(facts) == s.n_units + len(s.needles) and chunks == [""] * len(chunks)
        assert [v for k, v in facts if v in s.references] == s.references


def test_ruler_template_wording(tok):
    builder = NiahBuilder(tok, "ruler", bos_id=None)
    adjectives, nouns = key_words()
    s = builder.build("niah_single_3", 1200, sample_seed(1, "niah_single_3", 1200, 0))
    text, (key,), (value,) = tok.decode(s.ids), s.queries, s.references
    assert UUID4.match(value)
    adj, noun = key.split("-")
    assert adj in adjectives and noun in nouns
    assert text.startswith(
        "A special magic uuid is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the uuid afterwards.\n"
    )
    assert text.endswith(
        f"\nWhat is the special magic uuid for {key} mentioned in the provided text? "
        f"The special magic uuid for {key} mentioned in the provided text is"
    )
    assert RULER_FACT.findall(text) == [(key, value)]
    assert f"One of the special magic uuids for {key} is: {value}." in text

    s = builder.build("niah_multiquery", 1200, sample_seed(1, "niah_multiquery", 1200, 0))
    text = tok.decode(s.ids)
    a, b, c, d = s.queries
    assert text.startswith("Some special magic numbers are hidden within the following text.")
    assert text.endswith(
        f"\nWhat are all the special magic numbers for {a}, {b}, {c}, and {d} mentioned in the "
        f"provided text? The special magic numbers for {a}, {b}, {c}, and {d} mentioned in the "
        "provided text are"
    )
    assert sorted(RULER_FACT.findall(text)) == sorted(s.needles)
    assert s.references == [dict(s.needles)[k] for k in s.queries]
    assert all(re.fullmatch(r"\d{7}", v) for v in s.references) and s.max_new_tokens == 128

    s = builder.build("niah_multikey_2", 1200, sample_seed(1, "niah_multikey_2", 1200, 0))
    lines = tok.decode(s.ids).split("\n")[1:-1]  # distractor needles, one per line
    facts = [RULER_FACT.fullmatch(line).groups() for line in lines]
    assert len(facts) == s.n_units + 1 and len({k for k, _ in facts}) == len(facts)
    assert [v for k, v in facts if k == s.queries[0]] == s.references


def test_haystack_file(tok, tmp_path):
    path = tmp_path / "essay.txt"
    path.write_text("Alpha beta gamma.  Delta\nepsilon!\n\nZeta eta theta? Iota kappa lambda mu.\n")
    words = read_haystack(path)
    assert words[:4] == ["Alpha", "beta", "gamma.", "Delta"] and len(words) == 12
    builder = NiahBuilder(tok, "ruler", None, words)
    s = builder.build("niah_multivalue", 900, sample_seed(3, "niah_multivalue", 900, 0))
    context = tok.decode(s.ids).split("\n")[1]
    pieces = re.split(r" ?One of the special magic numbers for \S+ is: \d+\. ?", context)
    hay = " ".join(p for p in pieces if p).split()
    assert len(hay) == s.n_units > 2 * len(words)  # cycled
    assert hay == [words[i % len(words)] for i in range(len(hay))]
    for at in s.needle_at:  # at a sentence start
        assert at in (0, len(hay)) or hay[at - 1][-1] in ".!?"
    with pytest.raises(RulerInputError, match="--haystack: .*missing.txt not found"):
        read_haystack(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text(" \n")
    with pytest.raises(RulerInputError, match="--haystack: .*has no words"):
        read_haystack(tmp_path / "blank.txt")


def test_too_short_length_is_refused(tok):
    builder = NiahBuilder(tok, "corpus", bos_id=0)
    with pytest.raises(RulerInputError, match="--lengths: 40 is too short for niah_multivalue"):
        builder.build("niah_multivalue", 40, sample_seed(0, "niah_multivalue", 40, 0))


# --- the runner: an oracle that reads the needles from the prompt ----------------------


def _oracle(tok, template: str, shift: int):
    """A decoder that answers from the prompt's own needles (values + shift if numeric)."""
    fact = FACT if template == "corpus" else RULER_FACT

    def bump(v: str) -> str:
        if not shift:
            return v
        return str(int(v) + shift) if v.isdigit() else v[:-1] + ("0" if v[-1] != "0" else "1")

    def generate(model, prompt, n_new, **kwargs):
        text = tok.decode(prompt[0].tolist())
        facts = fact.findall(text)
        if template == "corpus":
            keys = [re.search(r"recall key (\d+) :$", text).group(1)]
            answer = "".join(f" {bump(v)}" for k in keys for kk, v in facts if kk == k)
        else:
            asked = re.search(r"for ([^?]+) mentioned in the provided text (?:is|are)$", text)
            keys = re.split(r", and |, ", asked.group(1))
            answer = " " + ", ".join(bump(v) for k in keys for kk, v in facts if kk == k) + "."
        ids = tok.encode(answer, add_special_tokens=False).ids[:n_new]
        return GenerationResult([ids], torch.zeros(1))

    return generate


@pytest.mark.parametrize("template", ["corpus", "ruler"])
def test_oracle_scores_100_and_a_wrong_decoder_does_not(tok, monkeypatch, template):
    cfg = RulerConfig(lengths=[700], samples=2, seed=5, template=template)
    monkeypatch.setattr(ruler, "greedy_generate", _oracle(tok, template, 0))
    report = run_ruler(None, tok, cfg, eos_ids=[1], bos_id=0, progress=lambda *_: None)
    assert {t: r["700"]["score"] for t, r in report["tasks"].items()} == dict.fromkeys(TASKS, 100)
    assert report["average"] == {"700": 100.0, "all": 100.0}
    monkeypatch.setattr(ruler, "greedy_generate", _oracle(tok, template, 1))
    report = run_ruler(None, tok, cfg, eos_ids=[1], bos_id=0, progress=lambda *_: None)
    assert all(r["700"]["score"] < 100 for r in report["tasks"].values())


def test_chained_questions_see_their_own_answers(tok, monkeypatch):
    """Corpus multiquery: question i+1 follows answer i and " ." in the same context."""
    s = NiahBuilder(tok, "corpus", 0).build(
        "niah_multiquery", 400, sample_seed(0, "niah_multiquery", 400, 0)
    )
    calls = []

    def record(model, prompt, n_new, *, stop_ids, min_new_tokens, budget):
        calls.append((prompt[0].tolist(), n_new, list(stop_ids), min_new_tokens))
        return GenerationResult([_enc(tok, f" {len(calls)}0{len(calls)}")], torch.zeros(1))

    monkeypatch.setattr(ruler, "greedy_generate", record)
    assert ruler.predict(None, tok, s, [1], 1.0) == " 101  202  303  404"
    period = _enc(tok, " .")
    assert [c[1:] for c in calls] == [(8, [1, *period], 1)] * 4
    for i in range(3):
        answer = _enc(tok, f" {i + 1}0{i + 1}")
        assert calls[i + 1][0] == calls[i][0] + answer + s.followups[i]
    assert tok.decode(calls[-1][0]).endswith(f" 303 . recall key {s.queries[3]} :")


# --- the CLI ------------------------------------------------------------------------------


def test_cli_on_a_tiny_checkpoint(tiny_checkpoint, tmp_path, capsys):
    base = ["ruler", "--checkpoint", str(tiny_checkpoint), "--config", str(DEBUG_TOML)]
    base += ["--lengths", "256,0.375k", "--samples", "1", "--threads", "1"]
    for mode in ("dense", "sparse"):
        out = tmp_path / mode
        eval_main([*base, "--attention", mode, "--budget", "0.5", "--out", str(out)])
        printed = capsys.readouterr().out
        assert "template: corpus" in printed and "niah_multiquery" in printed
        result = json.loads((out / "result.json").read_text())
        assert result["attention"] == mode and result["template"] == "corpus"
        assert result["budget"] == (0.5 if mode == "sparse" else 1.0)
        assert set(result["tasks"]) == set(TASKS) and set(result["average"]) == {
            "256",
            "384",
            "all",
        }
        for task, row in result["tasks"].items():
            for length, cell in row.items():
                assert 0.0 <= cell["score"] <= 100.0 and cell["n"] == 1
                assert cell["prompt_tokens"] < int(length)
                pred = json.loads((out / "pred" / f"{task}-{length}.jsonl").read_text())
                assert string_match_all([pred["pred"]], [pred["outputs"]]) == cell["score"]
        assert (out / "ruler.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tasks", "niah_single_1,niah_bogus"], "--tasks: unknown task(s) ['niah_bogus']"),
        (["--lengths", "1k,abc"], "--lengths '1k,abc': expected token counts"),
        (["--haystack", "/nonexistent/essay.txt"], "--haystack: /nonexistent/essay.txt not found"),
        (["--samples", "0"], "--samples 0: expected a positive integer"),
        (["--lengths", "64k"], "--lengths: 65536 exceeds the model's 32768 positions"),
        (["--lengths", "48", "--tasks", "niah_multiquery"], "--lengths: 48 is too short for"),
    ],
)
def test_cli_bad_input_is_one_line(tiny_checkpoint, flags, message):
    args = ["ruler", "--checkpoint", str(tiny_checkpoint), "--config", str(DEBUG_TOML), *flags]
    with pytest.raises(SystemExit) as exc:
        eval_main(args)
    assert str(exc.value).startswith("sb-eval: ") and message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_cli_ruler_template_on_hf_with_a_haystack_file(tmp_path):
    pytest.importorskip("transformers")
    from conftest import tiny_hf_qwen2, tiny_qwen_tokenizer

    hf = tmp_path / "hf"
    tiny_hf_qwen2(hf, False, vocab_size=320, max_position_embeddings=1024)
    essay = "The river bends twice. Birds rest on the old stone bridge! Who built it? " * 3
    text = " ".join(
        [RULER_TEMPLATE, RULER_ANSWER_PREFIX, essay, RULER_NEEDLE, "calm-river 1234567 uuids"]
    )
    tiny_qwen_tokenizer(hf, vocab_size=320, text=text * 20)
    (tmp_path / "essay.txt").write_text(essay)
    out = tmp_path / "out"
    eval_main(
        ["ruler", "--hf", str(hf), "--tasks", "niah_single_2,niah_multiquery", "--lengths", "640"]
        + ["--samples", "1", "--haystack", str(tmp_path / "essay.txt"), "--out", str(out)]
    )
    result = json.loads((out / "result.json").read_text())
    assert result["template"] == "ruler" and result["haystack"] == str(tmp_path / "essay.txt")
    assert result["attention"] == "dense" and set(result["tasks"]) == {
        "niah_single_2",
        "niah_multiquery",
    }
    pred = json.loads((out / "pred" / "niah_multiquery-640.jsonl").read_text())
    assert len(pred["outputs"]) == 4 and all(re.fullmatch(r"\d{7}", v) for v in pred["outputs"])
    assert pred["length"] + 128 <= 640
