"""LongBench's official scoring (metrics.py and eval.py), reimplemented without deps.

Scores must be comparable with published LongBench numbers, so every function mirrors
the reference code, quirks included: ROUGE-L is the `rouge` package's summary-level
variant (sentences split on ".", unique words, union LCS), and the code similarity is
fuzzywuzzy's `ratio` (Indel / python-Levenshtein ratio, rounded to an integer percent).
Only the English tasks are covered (the Chinese ones need jieba segmentation).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and articles (a/an/the), collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Bag-of-tokens F1 (SQuAD style)."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _number_share(prediction: str, target: str) -> float:
    """Share of the numbers in the prediction that equal the target (0 if none)."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(target) for n in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return float(_number_share(prediction, ground_truth))


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    (paragraph, *_) = re.findall(r"Paragraph (\d+)", ground_truth)
    return float(_number_share(prediction, paragraph))


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/k if the true class is among the k class names found in the prediction.

    Class names that are substrings of the true class are dropped first, with the
    reference's remove-while-iterating loop (which can skip an element) kept as is.
    """
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    for term in matches:  # noqa: B909 - reproduces the reference's iteration exactly
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


# -- ROUGE-L, as the `rouge` package (pltrdy, exclusive=True) computes it -------------------
def _lcs_words(x: list[str], y: list[str]) -> set[str]:
    """Words of one LCS of x and y, with the package's backtracking tie-break."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev, xi = table[i], table[i - 1], x[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if xi == y[j - 1] else max(prev[j], row[j - 1])
    words, i, j = set(), n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def _words(sentences: list[str]) -> list[str]:
    return [w for s in sentences for w in s.split(" ")]


def rouge_l(prediction: str, ground_truth: str) -> float:
    """Summary-level ROUGE-L F; raises ValueError on an empty side like the package."""
    hyp, ref = _sentences(prediction), _sentences(ground_truth)
    if not hyp or not ref:
        raise ValueError("Collections must contain at least 1 sentence.")
    m, n = len(set(_words(ref))), len(set(_words(hyp)))
    union: set[str] = set()
    llcs = 0
    for ref_s in ref:
        ref_words = ref_s.split(" ")
        before = len(union)
        for hyp_s in hyp:
            union |= _lcs_words(ref_words, hyp_s.split(" "))
        llcs += len(union) - before
    r, p = llcs / m, llcs / n
    return 2.0 * (p * r) / (p + r + 1e-8)


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    try:
        return rouge_l(prediction, ground_truth)
    except (ValueError, ZeroDivisionError):  # the reference catches everything
        return 0.0


# -- code similarity: fuzzywuzzy.fuzz.ratio -----------------------------------------------
def _lcs_len(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if ca == cb else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def fuzz_ratio(a: str, b: str) -> int:
    """Integer percent similarity 100 * (1 - indel_distance / (len a + len b))."""
    if not a or not b:
        return 0
    total = len(a) + len(b)
    return int(round(100 * 2 * _lcs_len(a, b) / total))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """First generated line that is not a comment or a code fence, vs the reference."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth) / 100


Metric = Callable[..., float]

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")
"""Few-shot tasks whose prediction is cut to its first non-empty line before scoring."""


def sample_score(task: str, prediction: str, answers: list[str], all_classes) -> float:
    """Best score over the reference answers, in [0, 1]."""
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[task]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def scorer(task: str, predictions: list[str], answers: list[list[str]], all_classes) -> float:
    """Task score in percent, rounded to 2 decimals (LongBench eval.py)."""
    total = sum(
        sample_score(task, p, a, all_classes) for p, a in zip(predictions, answers, strict=True)
    )
    return round(100 * total / len(predictions), 2)


def scorer_e(
    task: str, predictions: list[str], answers: list[list[str]], lengths: list[int], all_classes
) -> dict[str, float]:
    """LongBench-E: score per length bucket (0-4k, 4-8k, 8k+ words); NaN if empty."""
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for pred, ans, length in zip(predictions, answers, lengths, strict=True):
        key = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        buckets[key].append(sample_score(task, pred, ans, all_classes))
    return {k: round(100 * sum(v) / len(v), 2) if v else float("nan") for k, v in buckets.items()}
