"""LongBench metrics: hand-computed cases, the reference code's quirks, and a cross-check
of every metric against an independent reading of the official definitions (LongBench
metrics.py / eval.py, the `rouge` package's summary-level ROUGE-L, fuzzywuzzy's ratio)
on hundreds of random pairs, English and Chinese."""

from __future__ import annotations

import math
import random
import re
import string

import jieba
import pytest

from sb_titan.eval.metrics import (
    DATASET2METRIC,
    classification_score,
    code_sim_score,
    count_score,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    sample_score,
    scorer,
    scorer_e,
)

# -- independent references, written from the official definitions -----------------------
ZH_PUNCT = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def ref_normalize(s: str) -> str:
    s = s.lower()
    s = "".join(c for c in s if c not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def ref_normalize_zh(s: str) -> str:
    drop = set(string.punctuation) | set(ZH_PUNCT)
    return "".join(c for c in s.lower() if c not in drop and not c.isspace())


def ref_f1(pred: list[str], gold: list[str]) -> float:
    remaining, same = list(gold), 0
    for tok in pred:  # multiset intersection by matching and striking out
        if tok in remaining:
            remaining.remove(tok)
            same += 1
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


def ref_qa_f1_zh(pred: str, gold: str) -> float:
    def toks(s):
        return [t for t in (ref_normalize_zh(w) for w in jieba.lcut(s)) if t]

    return ref_f1(toks(pred), toks(gold))


def ref_number_share(pred: str, target: str) -> float:
    nums = re.findall(r"\d+", pred)
    return sum(n == target for n in nums) / len(nums) if nums else 0.0


def ref_classification(pred: str, gold: str, classes: list[str]) -> float:
    found = [c for c in classes if c in pred]
    i = 0  # a Python for-loop over a list that shrinks under it: an index that moves on
    while i < len(found):
        term = found[i]
        if term in gold and term != gold:
            found.pop(found.index(term))
        i += 1
    return 1 / len(found) if gold in found else 0.0


def _lcs_table(x: list, y: list) -> list[list[int]]:
    t = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            t[i][j] = t[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(t[i - 1][j], t[i][j - 1])
    return t


def ref_rouge_l(hyp: str, ref: str) -> float:
    """Summary-level ROUGE-L F (Lin 2004, union LCS) with the `rouge` package's choices:
    sentences split on ".", words split on " ", unique-word counts, its LCS tie-break."""
    hs = [" ".join(s.split()) for s in hyp.split(".") if s]
    rs = [" ".join(s.split()) for s in ref.split(".") if s]
    if not hs or not rs:
        return 0.0  # the package raises; the scorer returns 0
    m = len({w for s in rs for w in s.split(" ")})
    n = len({w for s in hs for w in s.split(" ")})
    union: set[str] = set()
    hits = 0
    for r in rs:
        x = r.split(" ")
        before = len(union)
        for h in hs:
            y = h.split(" ")
            t, i, j = _lcs_table(x, y), len(x), len(y)
            while i and j:
                if x[i - 1] == y[j - 1]:
                    union.add(x[i - 1])
                    i, j = i - 1, j - 1
                elif t[i - 1][j] > t[i][j - 1]:
                    i -= 1
                else:
                    j -= 1
        hits += len(union) - before
    rec, prec = hits / m, hits / n
    return 2 * prec * rec / (prec + rec + 1e-8)


def ref_fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy: equal -> 100, an empty side -> 0, else round(100 * Indel similarity)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    lcs = _lcs_table(list(a), list(b))[-1][-1]
    return int(round(100 * 2 * lcs / (len(a) + len(b))))


def ref_code_sim(pred: str, gold: str) -> float:
    kept = [ln for ln in pred.lstrip("\n").split("\n") if not re.search(r"`|#|//", ln)]
    return ref_fuzz_ratio(kept[0] if kept else "", gold) / 100


# -- random inputs ------------------------------------------------------------------------
EN = "the a an cat Cat sat on mat. dog, runs! Paris paris 12 7 Paragraph 3 x-y it's".split()
ZH = "北城 红河 大桥 建成 一九八二年 月季 ， 。 ！ 《 》 的 是 会议 讨论 段落 3 12 了 . a".split()


def _text(rng: random.Random, vocab: list[str], max_words: int = 9, sep: str = " ") -> str:
    return sep.join(rng.choice(vocab) for _ in range(rng.randint(0, max_words)))


PAIRS = 300


def _pairs(vocab, sep=" ", seed=0, max_words=9):
    rng = random.Random(seed)
    return [
        (_text(rng, vocab, max_words, sep), _text(rng, vocab, max_words, sep)) for _ in range(PAIRS)
    ]


def test_qa_f1_matches_reference_on_random_pairs():
    for pred, gold in _pairs(EN):
        assert normalize_answer(pred) == ref_normalize(pred)
        want = ref_f1(ref_normalize(pred).split(), ref_normalize(gold).split())
        assert qa_f1_score(pred, gold) == pytest.approx(want, abs=1e-12), (pred, gold)


def test_qa_f1_zh_matches_reference_on_random_pairs():
    for pred, gold in _pairs(ZH, sep="", seed=1):
        assert normalize_zh_answer(pred) == ref_normalize_zh(pred)
        assert qa_f1_zh_score(pred, gold) == pytest.approx(ref_qa_f1_zh(pred, gold), abs=1e-12)


def test_rouge_matches_reference_on_random_pairs():
    for pred, gold in _pairs(EN, seed=2, max_words=14):
        assert rouge_score(pred, gold) == pytest.approx(ref_rouge_l(pred, gold), abs=1e-9)
    for pred, gold in _pairs(ZH, sep="", seed=3, max_words=14):
        want = ref_rouge_l(" ".join(jieba.lcut(pred)), " ".join(jieba.lcut(gold)))
        assert rouge_zh_score(pred, gold) == pytest.approx(want, abs=1e-9), (pred, gold)


def test_count_retrieval_classification_match_reference_on_random_pairs():
    rng = random.Random(4)
    digits = ["1", "2", "12", "3", "Paragraph 2", "段落2", "段落12", "x", " ", "３"]
    names = ["Date", "Date of birth", "City", "Cit", "ity", "农业", "农业、农村", "体育"]
    for _ in range(PAIRS):
        pred = _text(rng, digits, sep=rng.choice(["", " "]))
        n = str(rng.randint(1, 12))
        assert count_score(pred, n) == ref_number_share(pred, n)
        assert retrieval_score(pred, f"Paragraph {n}") == ref_number_share(pred, n)
        assert retrieval_zh_score(pred, f"段落{n}") == ref_number_share(pred, n)
        classes = rng.sample(names, rng.randint(1, len(names)))
        gold = rng.choice(classes)
        pred = _text(rng, names, max_words=4)
        assert classification_score(pred, gold, all_classes=classes) == ref_classification(
            pred, gold, classes
        ), (pred, gold, classes)


def test_code_sim_matches_reference_on_random_pairs():
    rng = random.Random(5)
    bits = ["x", " ", "=", "1", "a+b", "return", "#", "//", "`", "\n", "\n", "(", ")", "é"]
    for _ in range(PAIRS):
        pred = "".join(rng.choice(bits) for _ in range(rng.randint(0, 14)))
        gold = "".join(rng.choice(bits[:6]) for _ in range(rng.randint(0, 10)))
        assert code_sim_score(pred, gold) == ref_code_sim(pred, gold), (pred, gold)


# -- hand-computed cases and the reference's quirks ---------------------------------------
def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_zh_answer("《月季》， 花。") == "《月季花"  # "《" is not in the list


def test_qa_f1():
    # "eiffel tower paris" vs "eiffel tower": 2 common, p = 2/3, r = 1 -> F1 = 0.8
    assert qa_f1_score("The Eiffel Tower, Paris", "Eiffel tower") == pytest.approx(0.8)
    assert qa_f1_score("nothing", "Eiffel tower") == 0.0
    assert qa_f1_score("the", "a") == 0.0  # both normalise to nothing
    assert qa_f1_zh_score("月季。", "月季") == 1.0
    assert qa_f1_zh_score("一九八二年", "一九八二年") == 1.0
    assert qa_f1_zh_score("，", "月季") == 0.0


def test_count_and_retrieval():
    assert count_score("There are 12 unique, not 3", "12") == 0.5
    assert count_score("no digits", "12") == 0.0
    assert retrieval_score("Paragraph 5 and paragraph 7", "Paragraph 5") == 0.5
    assert retrieval_score("Paragraph 15", "Paragraph 5") == 0.0
    assert retrieval_score("It is 5.", "Paragraph 5") == 1.0
    assert retrieval_zh_score("答案是：段落2", "段落2") == 1.0
    assert retrieval_zh_score("段落2或段落3", "段落3") == 0.5


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
    zh_classes = ["农业", "农业、农村"]
    assert classification_score("农业、农村", "农业、农村", all_classes=zh_classes) == 1.0


def test_rouge_l():
    # one sentence each; unique words 5 and 5; LCS "the cat on the mat" -> {the, cat, on, mat}
    assert rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8)
    # summary level: sentences split on "."; union of LCS over hypothesis sentences
    assert rouge_score("a b. c d", "a b c d") == pytest.approx(1.0)
    # r = 2/4 (ref unique words), p = 2/2 -> F = 2/3
    assert rouge_score("a b", "a b c d") == pytest.approx(2 / 3)
    assert rouge_score("", "a b") == 0.0
    assert rouge_score("...", "a b") == 0.0
    # the package's recursive LCS overflows on one very long sentence: the scorer gives 0
    long = " ".join(f"w{i}" for i in range(1200))
    assert rouge_score(long, long) == 0.0
    assert rouge_zh_score("会议讨论了发布时间", "会议讨论了发布时间") == pytest.approx(1.0)


def test_code_similarity():
    assert code_sim_score("kitten", "sitting") == 0.62  # 2 * 4 / 13 (LCS "ittn")
    assert code_sim_score("", "x") == 0.0
    # fuzzywuzzy tests equality before emptiness: an empty line against an empty answer
    assert code_sim_score("", "") == 1.0
    assert code_sim_score("# only a comment\n", "") == 1.0
    pred = "\n# a comment\n```python\n    return a + b\nprint(1)"
    assert code_sim_score(pred, "    return a + b") == 1.0
    assert code_sim_score("    return a - b", "    return a + b") == pytest.approx(0.94)


def test_sample_rules_and_task_scores():
    classes = ["Date", "City"]
    # trec / lsht: only the first non-empty line counts
    assert sample_score("trec", "\nDate\nCity", ["Date"], classes) == 1.0
    assert sample_score("lsht", "\n体育\n财经", ["体育"], ["体育", "财经"]) == 1.0
    assert classification_score("\nDate\nCity", "Date", all_classes=classes) == 0.5
    # max over reference answers
    assert sample_score("hotpotqa", "eiffel tower", ["Paris", "Eiffel tower"], None) == 1.0
    assert scorer("hotpotqa", ["Paris", "x"], [["Paris"], ["Rome"]], None) == 50.0
    assert scorer("hotpotqa", ["x y z"], [["x y"]], None) == 80.0
    buckets = scorer_e("hotpotqa", ["Paris", "x"], [["Paris"], ["Rome"]], [100, 9000], None)
    assert buckets["0-4k"] == 100.0 and buckets["8k+"] == 0.0 and math.isnan(buckets["4-8k"])
    assert len(DATASET2METRIC) == 21


# LongBench's eval.py as it runs: a fresh `python eval.py`, whose module-level loop calls
# scorer -> rouge_score / rouge_zh_score (metrics.py, verbatim but for the loop and one
# split line). It finds the first length at which the `rouge` package's recursive LCS
# overflows there.
_FRESH_LONGBENCH = """
import json, sys
import jieba
from rouge import Rouge

def rouge_score(prediction, ground_truth, **kwargs):
    rouge = Rouge()
    try:
        scores = rouge.get_scores([prediction], [ground_truth], avg=True)
    except:
        return 0.0
    return scores["rouge-l"]["f"]

def rouge_zh_score(prediction, ground_truth, **kwargs):
    prediction = " ".join(list(jieba.cut(prediction, cut_all=False)))
    ground_truth = " ".join(list(jieba.cut(ground_truth, cut_all=False)))
    score = rouge_score(prediction, ground_truth)
    return score

dataset2metric = {"gov_report": rouge_score, "vcsum": rouge_zh_score}

def scorer(dataset, predictions, answers, all_classes):
    total_score = 0.
    for (prediction, ground_truths) in zip(predictions, answers):
        score = 0.
        for ground_truth in ground_truths:
            metric = dataset2metric[dataset]  # one line in the reference, same frames
            score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
        total_score += score
    return round(100 * total_score / len(predictions), 2)

pairs = json.loads(sys.argv[1])
first_zero = {}
for dataset, (pred, unit, lo, hi) in pairs.items():
    while lo < hi:  # the first n whose score is 0; scores > 0 below it
        n = (lo + hi) // 2
        if scorer(dataset, [pred], [[pred + unit * n]], None) == 0:
            hi = n
        else:
            lo = n + 1
    first_zero[dataset] = lo
print(json.dumps({"limit": sys.getrecursionlimit(), "first_zero": first_zero}))
"""

# one matching word, then n words that match nothing: the package's LCS walks back
# through all of them, one frame each, at linear cost
_LONG_PAIRS = {"gov_report": ("w", " x", 1, 1200), "vcsum": ("会议", "，讨论", 1, 700)}


def _deep(frames: int, fn):
    return _deep(frames - 1, fn) if frames else fn()


def test_rouge_overflow_length_is_the_fresh_process_one_whatever_ran_before():
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_LONGBENCH, json.dumps(_LONG_PAIRS)],
        capture_output=True,
        text=True,
        check=True,
    )
    fresh = json.loads(proc.stdout)
    assert fresh["limit"] == 1000
    metrics = {"gov_report": rouge_score, "vcsum": rouge_zh_score}

    def scores():
        out = {}
        for dataset, (pred, unit, _, _) in _LONG_PAIRS.items():
            n = fresh["first_zero"][dataset]
            out[dataset] = [metrics[dataset](pred, pred + unit * k) for k in (n - 1, n)]
        return out

    before = scores()
    for dataset in _LONG_PAIRS:  # the fresh process's boundary, here
        assert before[dataset][0] > 0 and before[dataset][1] == 0.0, (dataset, fresh)
    assert _deep(300, scores) == before  # called from deep inside a stack
    limit = sys.getrecursionlimit()
    try:
        # what TorchInductor's compile_fx does whenever it compiles (never undone)
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 2000))
        assert scores() == before
        assert sys.getrecursionlimit() == max(limit, 2000)  # the caller's limit is kept
    finally:
        sys.setrecursionlimit(limit)
