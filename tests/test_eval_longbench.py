"""LongBench prompts, truncation and an end-to-end run on a tiny random checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from sb_titan.data.tokenizer import load_tokenizer
from sb_titan.eval.longbench import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    TASKS,
    ZH_TASKS,
    LongBenchConfig,
    build_prompt,
    category_averages,
    load_task,
    run_longbench,
    sample_score_of,
    truncate_middle,
)
from sb_titan.tools.eval import main as eval_main

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
DEBUG_TOML = Path(__file__).resolve().parents[1] / "train_configs" / "debug_cpu.toml"


def test_templates_and_generation_lengths():
    assert len(TASKS) == 21 and len(set(TASKS)) == 21
    for template in DATASET2PROMPT.values():
        assert "{context}" in template
        assert template.format(context="C", input="I")  # no other fields
    assert DATASET2MAXLEN["gov_report"] == 512 and DATASET2MAXLEN["hotpotqa"] == 32
    assert DATASET2MAXLEN["narrativeqa"] == 128 and DATASET2MAXLEN["lcc"] == 64
    assert DATASET2MAXLEN["vcsum"] == 512 and DATASET2MAXLEN["dureader"] == 128
    zh = build_prompt("passage_retrieval_zh", load_task(FIXTURES, "passage_retrieval_zh")[0])
    assert zh.startswith("以下是若干段落文字") and zh.endswith('"段落1"，"段落2"等格式\n\n答案是：')
    sample = load_task(FIXTURES, "hotpotqa")[0]
    prompt = build_prompt("hotpotqa", sample)
    assert prompt.startswith("Answer the question based on the given passages.")
    assert "The following are given passages.\nPassage 1:\nKestrel river" in prompt
    assert prompt.endswith(f"Question: {sample['input']}\nAnswer:")
    assert build_prompt("lcc", {"context": "x = 1\n", "input": ""}) == (
        "Please complete the code given below. \nx = 1\nNext line of code:\n"
    )


def test_middle_truncation_keeps_head_and_tail():
    tok = load_tokenizer()
    text = "HEAD " + " ".join(f"w{i}" for i in range(400)) + " TAIL"
    ids = tok.encode(text).ids
    assert truncate_middle(ids, len(ids), tok) == ids
    cut = truncate_middle(ids, 64, tok)
    assert abs(len(cut) - 64) <= 2
    decoded = tok.decode(cut)
    assert decoded.startswith("HEAD w0 w1") and decoded.endswith("w399 TAIL")
    assert tok.decode(ids[:32]) + tok.decode(ids[-32:]) == decoded


ORACLE_TASKS = ("hotpotqa", "trec", *ZH_TASKS)


class _Oracle:
    """Answers with the reference: the pipeline (decode, file, score) must give 100."""

    def __init__(self, data_dir: Path):
        self.tokenizer, self.eos_ids = load_tokenizer(), [1]
        self.answers = {
            s["input"] or s["context"]: s["answers"][0]
            for t in ORACLE_TASKS
            for s in load_task(data_dir, t)
        }

    def generate(self, ids, max_new_tokens, stop_ids=None, min_new_tokens=0):
        text = self.tokenizer.decode(ids)
        answer = next(a for q, a in self.answers.items() if q in text)
        return self.tokenizer.encode(" " + answer).ids


def test_scoring_pipeline_with_oracle_predictions(tmp_path):
    cfg = LongBenchConfig(FIXTURES, ORACLE_TASKS)
    report = run_longbench(_Oracle(FIXTURES), cfg, tmp_path, progress=lambda *_: None)
    assert {t: r["score"] for t, r in report["tasks"].items()} == dict.fromkeys(ORACLE_TASKS, 100.0)
    assert set(report["categories"]) == {
        "single-doc QA",
        "multi-doc QA",
        "summarization",
        "few-shot",
        "synthetic",
        "average (en)",
        "average (zh)",
        "average",
    }
    assert set(report["categories"].values()) == {100.0}
    row = json.loads((tmp_path / "pred" / "lsht.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert row["pred"].strip() == "体育"
    rows = [
        json.loads(line) for line in (tmp_path / "pred" / "trec.jsonl").read_text().splitlines()
    ]
    assert set(rows[0]) == {"pred", "answers", "all_classes", "length"}
    assert rows[0]["all_classes"][2] == "Mountain"


def test_category_averages():
    got = category_averages({"hotpotqa": 10.0, "musique": 20.0, "trec": 60.0})
    assert got == {"multi-doc QA": 15.0, "few-shot": 60.0, "average": 30.0}
    got = category_averages({"hotpotqa": 10.0, "dureader": 40.0, "lsht": 70.0})
    assert got == {
        "multi-doc QA": 25.0,
        "few-shot": 70.0,
        "average (en)": 10.0,
        "average (zh)": 55.0,
        "average": 40.0,
    }


def test_end_to_end_on_a_tiny_checkpoint(tiny_checkpoint, tmp_path, capsys):
    args = ["longbench", "--checkpoint", str(tiny_checkpoint), "--config", str(DEBUG_TOML)]
    args += ["--data", str(FIXTURES), "--tasks", "hotpotqa,trec,lcc,lsht", "--threads", "1"]
    eval_main(
        [
            *args,
            "--attention",
            "sparse",
            "--budget",
            "0.5",
            "--max-length",
            "96",
            "--out",
            str(tmp_path / "s"),
        ]
    )
    table = capsys.readouterr().out
    assert "hotpotqa" in table and "average" in table and "sparse prefill, budget 0.5" in table
    result = json.loads((tmp_path / "s" / "result.json").read_text())
    assert set(result["tasks"]) == {"hotpotqa", "trec", "lcc", "lsht"}
    assert result["attention"] == "sparse" and result["budget"] == 0.5
    for task in ("hotpotqa", "trec", "lcc", "lsht"):
        rows = [
            json.loads(line)
            for line in (tmp_path / "s" / "pred" / f"{task}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 2
        rescored = round(100 * sum(sample_score_of(task, r) for r in rows) / 2, 2)
        assert rescored == result["tasks"][task]["score"]
        assert 0.0 <= rescored <= 100.0

    # dense through the checkpoint == dense through its HF export (same predictions)
    from sb_titan.tools.export import main as export_main

    export_main(
        [
            "--checkpoint",
            str(tiny_checkpoint),
            "--config",
            str(DEBUG_TOML),
            "--out",
            str(tmp_path / "hf"),
        ]
    )
    eval_main([*args, "--attention", "dense", "--out", str(tmp_path / "d")])
    hf_args = [
        "longbench",
        "--hf",
        str(tmp_path / "hf"),
        "--data",
        str(FIXTURES),
        "--tasks",
        "hotpotqa,trec,lcc,lsht",
    ]
    eval_main([*hf_args, "--out", str(tmp_path / "h")])
    for task in ("hotpotqa", "trec", "lcc", "lsht"):
        dense = (tmp_path / "d" / "pred" / f"{task}.jsonl").read_text()
        assert dense == (tmp_path / "h" / "pred" / f"{task}.jsonl").read_text()
