"""LongBench metrics on hand-computed cases (the reference code's behaviour, quirks included)."""

from __future__ import annotations

import math

import pytest

from sb_titan.eval.metrics import (
    DATASET2METRIC,
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    sample_score,
    scorer,
    scorer_e,
)


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"


def test_qa_f1():
    # "eiffel tower paris" vs "eiffel tower": 2 common, p = 2/3, r = 1 -> F1 = 0.8
    assert qa_f1_score("The Eiffel Tower, Paris", "Eiffel tower") == pytest.approx(0.8)
    assert qa_f1_score("nothing", "Eiffel tower") == 0.0
    assert qa_f1_score("the", "a") == 0.0  # both normalise to nothing


def test_count_and_retrieval():
    assert count_score("There are 12 unique, not 3", "12") == 0.5
    assert count_score("no digits", "12") == 0.0
    assert retrieval_score("Paragraph 5 and paragraph 7", "Paragraph 5") == 0.5
    assert retrieval_score("Paragraph 15", "Paragraph 5") == 0.0
    assert retrieval_score("It is 5.", "Paragraph 5") == 1.0


def test_classification():
    classes = ["Date", "Individual", "City", "Description"]
    assert classification_score("Date or City", "Date", all_classes=classes) == 0.5
    assert classification_score("City", "Date", all_classes=classes) == 0.0
    # a class that is a substring of the true class does not count against it
    assert (
        classification_score("Human being", "Human being", all_classes=["Human being", "Human"])
        == 1.0
    )
    # the reference removes while iterating, so "b" survives: 1/2, not 1
    assert classification_score("a b", "a b", all_classes=["a b", "a", "b"]) == 0.5


def test_rouge_l():
    # one sentence each; unique words 5 and 5; LCS "the cat on the mat" -> {the, cat, on, mat}
    assert rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8)
    # summary level: sentences split on "."; union of LCS over hypothesis sentences
    assert rouge_score("a b. c d", "a b c d") == pytest.approx(1.0)
    # r = 2/4 (ref unique words), p = 2/2 -> F = 2/3
    assert rouge_score("a b", "a b c d") == pytest.approx(2 / 3)
    assert rouge_score("", "a b") == 0.0
    assert rouge_score("...", "a b") == 0.0


def test_code_similarity():
    assert fuzz_ratio("kitten", "sitting") == 62  # 2 * 4 / 13 (LCS "ittn")
    assert fuzz_ratio("", "x") == 0
    pred = "\n# a comment\n```python\n    return a + b\nprint(1)"
    assert code_sim_score(pred, "    return a + b") == 1.0
    assert code_sim_score("    return a - b", "    return a + b") == pytest.approx(0.94)


def test_sample_rules_and_task_scores():
    classes = ["Date", "City"]
    # trec: only the first non-empty line counts
    assert sample_score("trec", "\nDate\nCity", ["Date"], classes) == 1.0
    assert classification_score("\nDate\nCity", "Date", all_classes=classes) == 0.5
    # max over reference answers
    assert sample_score("hotpotqa", "eiffel tower", ["Paris", "Eiffel tower"], None) == 1.0
    assert scorer("hotpotqa", ["Paris", "x"], [["Paris"], ["Rome"]], None) == 50.0
    assert scorer("hotpotqa", ["x y z"], [["x y"]], None) == 80.0
    buckets = scorer_e("hotpotqa", ["Paris", "x"], [["Paris"], ["Rome"]], [100, 9000], None)
    assert buckets["0-4k"] == 100.0 and buckets["8k+"] == 0.0 and math.isnan(buckets["4-8k"])
    assert len(DATASET2METRIC) == 16
