"""LongBench (v1, all 21 tasks) on local JSONL files, scored with the official metrics.

Prompts, generation lengths, middle truncation and the prediction file format follow
THUDM/LongBench (config/dataset2prompt.json, config/dataset2maxlen.json, pred.py,
eval.py), so a `pred/<task>.jsonl` written here can also be scored by LongBench's own
eval.py. Base (non-chat) models: no chat template is applied, as in pred.py for models
without one.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from sb_titan.eval.metrics import DATASET2METRIC, sample_score, scorer, scorer_e

_QA_MULTI = (
    "Answer the question based on the given passages. Only give me the answer and do not "
    "output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the "
    "question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question "
    'cannot be answered based on the information in the article, write "unanswerable". If '
    'the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not '
    "provide any explanation."
)

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a "
        "question. Answer the question as concisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the "
        "question based on the story as concisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question "
        + _QASPER_RULES
        + "\n\nArticle: {context}\n\n Answer the question based on the above article "
        + _QASPER_RULES
        + "\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the "
        "following question based on the above text, only give me the answer and do not "
        "output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，"
        "只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_MULTI,
    "2wikimqa": _QA_MULTI,
    "musique": _QA_MULTI,
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。"
        "\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the "
        "report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or "
        "instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}"
        "\n\nNow, answer the query based on the above meeting transcript in one or more "
        "sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\n"
        "News:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}"
        "\n\n会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of "
        "questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not "
        "output any other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some "
        "examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be "
        "duplicates. Please carefully read these paragraphs and determine how many unique "
        "paragraphs there are after removing duplicates. In other words, how many "
        "non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only "
        "contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
        "which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract."
        "\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. "
        'The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}"
        "\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"
        '"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

CATEGORIES: dict[str, tuple[str, ...]] = {
    "single-doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi-doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few-shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}
"""The LongBench paper's task groups (Chinese tasks sit with their English peers)."""
TASKS: tuple[str, ...] = tuple(t for tasks in CATEGORIES.values() for t in tasks)
ZH_TASKS: tuple[str, ...] = (
    "multifieldqa_zh",
    "dureader",
    "vcsum",
    "lsht",
    "passage_retrieval_zh",
)
EN_TASKS: tuple[str, ...] = tuple(t for t in TASKS if t not in ZH_TASKS)
assert set(TASKS) == set(DATASET2PROMPT) == set(DATASET2MAXLEN) == set(DATASET2METRIC)
assert len(TASKS) == 21

FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


@dataclass
class LongBenchConfig:
    data_dir: Path
    tasks: tuple[str, ...] = TASKS
    max_length: int = 31500
    """Prompt tokens kept (LongBench's model2maxlen; 31500 for 32k-context models)."""
    longbench_e: bool = False
    """Read `<task>_e.jsonl` (LongBench-E) and also score per length bucket."""
    limit: int | None = None
    """Evaluate only the first N samples of each task (smoke runs)."""


@dataclass
class TaskResult:
    task: str
    score: float
    n: int
    seconds: float
    by_length: dict[str, float] = field(default_factory=dict)


# Where the files come from, said wherever they are missing or malformed.
DATA_SOURCE = (
    "LongBench's data is data.zip from huggingface.co/datasets/THUDM/LongBench, unzipped: "
    "one <task>.jsonl (LongBench-E: <task>_e.jsonl) per task, one JSON object per line "
    "with input, context, answers, length, all_classes"
)


def task_path(data_dir: Path, task: str, longbench_e: bool = False) -> Path:
    return Path(data_dir) / f"{task}{'_e' if longbench_e else ''}.jsonl"


def check_tasks(data_dir: Path, tasks: tuple[str, ...], longbench_e: bool = False) -> None:
    """Every task's file read and checked, before a model is loaded for them: a missing or
    malformed file is a ValueError naming it (and where the data comes from)."""
    missing = [task_path(data_dir, t, longbench_e) for t in tasks]
    missing = [str(p) for p in missing if not p.is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if missing[3:] else "")
        raise ValueError(f"longbench: not found: {shown}. {DATA_SOURCE}")
    for task in tasks:
        load_task(data_dir, task, longbench_e)


def load_task(data_dir: Path, task: str, longbench_e: bool = False) -> list[dict]:
    """Samples of one task from `<data_dir>/<task>[_e].jsonl` (LongBench's HF layout)."""
    if task not in DATASET2PROMPT:
        raise ValueError(f"longbench: unknown or unsupported task {task!r}; one of {TASKS}")
    path = task_path(data_dir, task, longbench_e)
    if not path.is_file():
        raise FileNotFoundError(f"longbench: {path} not found. {DATA_SOURCE}")
    samples = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"longbench: {path}:{i}: not JSON ({e.msg}). {DATA_SOURCE}") from None
        if not isinstance(sample, dict):
            raise ValueError(f"longbench: {path}:{i}: not a JSON object. {DATA_SOURCE}")
        missing = [f for f in ("input", "context", "answers") if f not in sample]
        if missing:
            raise ValueError(f"longbench: {path}:{i}: lacks field(s) {missing}. {DATA_SOURCE}")
        samples.append(sample)
    return samples


def build_prompt(task: str, sample: dict) -> str:
    return DATASET2PROMPT[task].format(**sample)


def truncate_middle(ids: list[int], max_length: int, tokenizer) -> list[int]:
    """pred.py's truncation: keep the first and last max_length/2 tokens, as text.

    LongBench decodes both halves (skipping special tokens), concatenates the text and
    tokenizes again, so the result can differ from max_length by a token or two.
    """
    if len(ids) <= max_length:
        return ids
    half = int(max_length / 2)
    text = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )
    return tokenizer.encode(text).ids


def prompt_ids(task: str, sample: dict, tokenizer, max_length: int) -> list[int]:
    return truncate_middle(tokenizer.encode(build_prompt(task, sample)).ids, max_length, tokenizer)


def stop_ids_for(task: str, tokenizer, eos_ids: list[int]) -> tuple[list[int], int]:
    """Stop tokens and minimum new tokens: samsum also stops at a newline, after >= 1
    token (pred.py's guard against endless "\\nDialogue" repetition)."""
    if task == "samsum":
        newline = tokenizer.encode("\n").ids[-1]
        return [*eos_ids, newline], 1
    return list(eos_ids), 0


def predict_task(generator, task: str, cfg: LongBenchConfig, progress=print) -> list[dict]:
    """Greedy predictions of one task, as LongBench's pred/<task>.jsonl records."""
    samples = load_task(cfg.data_dir, task, cfg.longbench_e)[: cfg.limit]
    stop, min_new = stop_ids_for(task, generator.tokenizer, generator.eos_ids)
    out = []
    for i, sample in enumerate(samples):
        ids = prompt_ids(task, sample, generator.tokenizer, cfg.max_length)
        new = generator.generate(
            ids, max_new_tokens=DATASET2MAXLEN[task], stop_ids=stop, min_new_tokens=min_new
        )
        pred = generator.tokenizer.decode(new, skip_special_tokens=True)
        out.append(
            {
                "pred": pred,
                "answers": sample["answers"],
                "all_classes": sample.get("all_classes"),
                "length": sample.get("length"),
            }
        )
        progress(f"  {task} {i + 1}/{len(samples)}: {len(ids)} prompt tokens")
    return out


def score_task(task: str, preds: list[dict], longbench_e: bool) -> tuple[float, dict]:
    predictions = [p["pred"] for p in preds]
    answers = [p["answers"] for p in preds]
    all_classes = preds[0]["all_classes"] if preds else None
    score = scorer(task, predictions, answers, all_classes) if preds else float("nan")
    by_length = {}
    if longbench_e and preds:
        lengths = [p["length"] for p in preds]
        by_length = scorer_e(task, predictions, answers, lengths, all_classes)
    return score, by_length


def _mean(scores: dict[str, float], tasks) -> float | None:
    got = [scores[t] for t in tasks if t in scores and not math.isnan(scores[t])]
    return round(sum(got) / len(got), 2) if got else None


def category_averages(scores: dict[str, float]) -> dict[str, float]:
    """Mean task score per LongBench category (over the tasks that were run), the overall
    mean, and the English / Chinese means when both languages were run (as the paper
    reports them)."""
    groups = dict(CATEGORIES)
    if any(t in scores for t in ZH_TASKS) and any(t in scores for t in EN_TASKS):
        groups.update({"average (en)": EN_TASKS, "average (zh)": ZH_TASKS})
    groups["average"] = tuple(scores)
    out = {name: _mean(scores, tasks) for name, tasks in groups.items()}
    return {name: v for name, v in out.items() if v is not None}


def run_longbench(generator, cfg: LongBenchConfig, out_dir: Path | None, progress=print) -> dict:
    """Predict and score every task; writes pred/<task>.jsonl and result.json to out_dir."""
    results: list[TaskResult] = []
    for task in cfg.tasks:
        t0 = time.perf_counter()
        preds = predict_task(generator, task, cfg, progress)
        score, by_length = score_task(task, preds, cfg.longbench_e)
        results.append(TaskResult(task, score, len(preds), time.perf_counter() - t0, by_length))
        if out_dir is not None:
            pred_dir = Path(out_dir) / "pred"
            pred_dir.mkdir(parents=True, exist_ok=True)
            with (pred_dir / f"{task}.jsonl").open("w", encoding="utf-8") as f:
                for p in preds:
                    f.write(json.dumps(p, ensure_ascii=False) + "\n")
        progress(f"{task}: {score:.2f} ({len(preds)} samples)")
    scores = {r.task: r.score for r in results}
    report = {
        "tasks": {
            r.task: {"score": r.score, "n": r.n, "seconds": round(r.seconds, 2)} for r in results
        },
        "categories": category_averages(scores),
        "max_length": cfg.max_length,
    }
    for r in results:
        if r.by_length:
            report["tasks"][r.task]["by_length"] = r.by_length
    if out_dir is not None:
        (Path(out_dir) / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict) -> str:
    lines = [f"{'task':<22}{'score':>8}{'n':>6}", "-" * 36]
    for task, r in report["tasks"].items():
        lines.append(f"{task:<22}{r['score']:>8.2f}{r['n']:>6}")
    lines.append("-" * 36)
    for name, score in report["categories"].items():
        lines.append(f"{name:<22}{score:>8.2f}")
    return "\n".join(lines)


def sample_score_of(task: str, record: dict) -> float:
    """Score of one prediction record (for inspection and tests)."""
    return sample_score(task, record["pred"], record["answers"], record["all_classes"])
