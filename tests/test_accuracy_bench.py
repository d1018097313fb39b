"""bench/accuracy.py: `--quick` fine-tunes the pretrained base (2 variants, real torchrun) and
scores it; the bootstrap intervals behave as intervals; the study refuses a base below its
bars or with other weights than its recipe pins; pretraining trains each stage in chunks
until its bar. No accuracy figure of the full study is asserted here; the shipped base
must recall within its pretraining context."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cpu_env, forked_torchrun

_spec = importlib.util.spec_from_file_location("accuracy_bench", REPO / "bench" / "accuracy.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["accuracy_bench"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)


def test_bootstrap_is_an_interval_over_seeds_and_items():
    rng = np.random.default_rng(0)
    em = (rng.random((3, 400)) < 0.6).astype(float)
    mean, lo, hi = bench.bootstrap(em)
    assert mean == pytest.approx(em.mean()) and lo < mean < hi
    assert 0.02 < hi - lo < 0.2  # ~ 1.96 * 2 * sqrt(.24 / 1200) plus the seed spread
    assert bench.bootstrap(np.ones((3, 50))) == (1.0, 1.0, 1.0)
    same = bench.bootstrap(em, em)
    assert same == (0.0, 0.0, 0.0)  # paired: identical variants differ by exactly 0
    better = em.copy()
    better[:, :100] = 1.0
    d, d_lo, d_hi = bench.bootstrap(better, em)
    assert d > 0 and d_lo > 0  # a real improvement on paired items is detected
    # seeds that disagree widen the interval beyond the items' own spread
    spread = em.copy()
    spread[0] = 0.0
    assert np.diff(bench.bootstrap(spread)[1:])[0] > hi - lo


def _quick(out, root, base, timeout: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "bench" / "accuracy.py"), "--quick", "--base", str(base)]
    return subprocess.run(
        [*cmd, "--out", str(out), "--root", str(root)],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _must_not_train(*args) -> None:
    raise AssertionError(f"a finished run was trained again: {args}")


@pytest.mark.torchrun
def test_quick_study_fine_tunes_the_base_and_scores_it(
    tmp_path, monkeypatch, capsys, keep_torch_threads
):
    """With the shipped base: fine-tuning starts from it, so the result still recalls.
    The study runs in this process (its command line is the refusal test's below). The
    dense run is the bench's own launch, sb-launch with 2 ranks; the sparse run's 2 ranks
    fork from this process's server (what a launch costs is its server's imports)."""
    bench_launch = bench.torchrun

    def launch(config, dump, args, log) -> None:
        own = dump.parent.name == "dense"
        (bench_launch if own else _forked_bench_run)(config, dump, args, log)

    monkeypatch.setattr(bench, "torchrun", launch)
    base = bench.BASE
    out = tmp_path / "accuracy.json"
    argv = ["--quick", "--base", str(base), "--out", str(out), "--root", str(tmp_path / "runs")]
    monkeypatch.setattr(sys, "argv", ["bench/accuracy.py", *argv])
    bench.main()
    assert "[2/2]" in capsys.readouterr().out  # both variants trained
    result = json.loads(out.read_text())
    assert result["settings"]["base_sha256"] == bench.sha256(base / "model.safetensors")
    runs = result["runs"]
    assert set(runs) == {"dense/seed0", "sab_dst_recall/seed0"}
    for run in runs.values():
        assert len(run["series"]["loss"]) == 3
        assert len(run["dense"]["exact"]) == len(run["distances"]) > 0
    sparse = runs["sab_dst_recall/seed0"]
    assert len(sparse["series"]["density"]) == 3 and sparse["sparse"]["budget"] == bench.BETA0
    # the sparse layers measured true recall and top-key hits on sampled queries
    assert all(0 < x <= 1 for k in ("true_recall", "top_key_hit") for x in sparse["series"][k])
    assert "sparse" not in runs["dense/seed0"]
    assert "budget_mean" not in runs["dense/seed0"]["series"]  # no budget applies to dense
    # fine-tuning started from the base, not from a random init: it recalls
    assert runs["dense/seed0"]["dense"]["em"] >= 0.3
    # resumable: a second invocation finds every run done and trains nothing
    monkeypatch.setattr(bench, "torchrun", _must_not_train)
    bench.main()
    assert "[1/2]" not in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"] == runs


def _forked_bench_run(config, dump, args: list[str], log) -> None:
    """bench.torchrun's run (2 ranks, its log appended to `log`), the ranks forked from
    the test process's preloaded server (conftest.forked_torchrun): the pretraining
    schedule is under test here; the quick study's dense run is the bench's own launch."""
    argv = ["--config_file", str(config), "--dump_folder", str(dump), *args]
    proc = forked_torchrun(2, argv, timeout=600)
    with open(log, "a") as f:
        f.write(proc.stdout + proc.stderr)


@pytest.mark.torchrun
def test_pretrain_runs_its_stages_in_order_and_exports_the_last(tmp_path, monkeypatch):
    """Two tiny stages: the second starts from the first's final weights; the base is the
    second's model, exported with the recipe (command, stages, steps taken, held-out
    scores, sha256). The second stage's first chunk is scored below its bar (the only
    fake: 2 steps cannot learn recall), so a second chunk trains from the first's weights."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stages = (
        bench.Stage(128, 32, 4, rows=2, steps=3, bar=0.0, chunk=1, max_steps=3),
        bench.Stage(256, 64, 4, rows=1, steps=2, bar=0.5, chunk=1, max_steps=3),
    )
    monkeypatch.setattr(bench, "STAGES", stages)
    monkeypatch.setattr(bench, "STAGE_HELDOUT_DOCS", 8)  # the scores are not asserted on
    real_score = bench.score_stage

    def score(stage, checkpoint):
        out = real_score(stage, checkpoint)
        if stage is stages[1]:  # chunk 0 below the bar, chunk 1 above it
            out["exact_match"] = float(checkpoint.parents[1].name.endswith("_more1"))
        return out

    monkeypatch.setattr(bench, "score_stage", score)
    monkeypatch.setattr(bench, "torchrun", _forked_bench_run)
    base = tmp_path / "base"
    bench.pretrain(argparse.Namespace(root=str(tmp_path / "runs"), base=str(base)))
    runs = tmp_path / "runs" / "pretrain"
    first = runs / "stage0_128" / "checkpoint" / "step-3"
    assert f"Loading the checkpoint from {first}" in (runs / "stage1_256" / "train.log").read_text()
    chunk0 = runs / "stage1_256" / "checkpoint" / "step-2"
    more = (runs / "stage1_256_more1" / "train.log").read_text()
    assert f"Loading the checkpoint from {chunk0}" in more
    assert bench.finished(runs / "stage1_256_more1", 1)
    assert not (runs / "stage0_128_more1").exists()  # stage 0 cleared its bar in chunk 0
    recipe = json.loads((base / "recipe.json").read_text())
    assert [s["seq_len"] for s in recipe["stages"]] == [128, 256]
    assert [s["steps_taken"] for s in recipe["stages"]] == [3, 3]
    assert [c["steps"] for c in recipe["stages"][1]["chunks"]] == [2, 3]
    assert set(recipe) >= {"stage0_heldout_128", "stage1_heldout_256", "model_sha256"}
    assert recipe["stage1_heldout_256"]["exact_match"] == 1.0
    assert recipe["model_sha256"] == bench.sha256(base / "model.safetensors")
    assert bench.check_base(base, stages) == recipe["model_sha256"]


def _fake_stage_run(stage: bench.Stage, ems: list[float]):
    """The control loop's two callbacks: a chunk 'trains' by recording its steps, and the
    k-th score is ems[k]. Only the decisions are under test here, not the training."""
    trained: list[tuple[int, int]] = []

    def train_chunk(k: int, steps: int):
        trained.append((k, steps))
        return f"chunk{k}"

    def score(checkpoint):
        return {"exact_match": ems[len(trained) - 1], "loss": 3.0, "recalls": 256}

    return trained, train_chunk, score


def test_a_stage_trains_chunks_until_its_bar_and_records_the_steps(capsys):
    stage = bench.Stage(128, 32, 4, rows=8, steps=3000, bar=0.9, chunk=1000, max_steps=9000)
    trained, train_chunk, score = _fake_stage_run(stage, [0.047, 0.5, 0.93, 0.99])
    checkpoint, history = bench.train_until_bar(0, stage, train_chunk, score)
    assert trained == [(0, 3000), (1, 1000), (2, 1000)]  # stops at the first above the bar
    assert checkpoint == "chunk2"
    assert [h["steps"] for h in history] == [3000, 4000, 5000]
    assert [h["exact_match"] for h in history] == [0.047, 0.5, 0.93]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "chunk 2: 5000 steps, held-out EM 0.930 (bar 0.9)" in lines[2]
    assert "held-out loss 3.000" in lines[0]
    # a stage that clears its bar at once trains its nominal steps only
    trained, train_chunk, score = _fake_stage_run(stage, [0.9])
    assert bench.train_until_bar(0, stage, train_chunk, score)[1][-1]["steps"] == 3000
    assert trained == [(0, 3000)]


def test_a_stage_below_its_bar_at_its_cap_stops_with_one_line():
    stage = bench.Stage(512, 64, 8, rows=2, steps=1000, bar=0.85, chunk=400, max_steps=2000)
    assert stage.chunks() == [1000, 400, 400, 200]  # the last chunk stops at the cap
    trained, train_chunk, score = _fake_stage_run(stage, [0.1, 0.2, 0.3, 0.84])
    with pytest.raises(SystemExit) as exc:
        bench.train_until_bar(1, stage, train_chunk, score)
    assert sum(steps for _, steps in trained) == 2000 and len(trained) == 4
    message = str(exc.value.code)
    assert "\n" not in message
    assert "stage 1 (512 tokens)" in message and "0.840" in message and "2000 steps" in message
    with pytest.raises(ValueError):  # nominal steps beyond the cap
        bench.Stage(512, 64, 8, rows=2, steps=1000, bar=0.85, chunk=400, max_steps=900)


def test_the_shipped_base_passes_its_check_and_its_weights_are_pinned():
    recipe = json.loads((bench.BASE / "recipe.json").read_text())
    digest = bench.sha256(bench.BASE / "model.safetensors")
    assert digest == recipe["model_sha256"]
    assert bench.check_base(bench.BASE) == digest
    for i, stage in enumerate(bench.STAGES):
        assert recipe[f"stage{i}_heldout_{stage.seq_len}"]["exact_match"] >= stage.bar
        assert recipe["stages"][i]["seq_len"] == stage.seq_len


def _copy_base(tmp_path, **scores) -> tuple:
    """A copy of the shipped base whose recipe records other stage scores."""
    base = shutil.copytree(bench.BASE, tmp_path / "base")
    recipe = json.loads((base / "recipe.json").read_text())
    for key, em in scores.items():
        recipe[key]["exact_match"] = em
    (base / "recipe.json").write_text(json.dumps(recipe))
    return base, recipe


def test_a_base_below_its_bar_or_not_its_recipes_weights_is_refused(tmp_path):
    base, recipe = _copy_base(tmp_path, stage1_heldout_512=0.6)
    with pytest.raises(SystemExit) as exc:
        bench.check_base(base)
    message = str(exc.value.code)
    assert "\n" not in message
    assert "0.600 after stage 1 (512 tokens" in message and "below its bar 0.85" in message
    # the scores pass again, but the recipe pins other weights: refused, naming the file
    recipe["stage1_heldout_512"]["exact_match"] = 0.9219
    recipe["model_sha256"] = "0" * 64
    (base / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(SystemExit) as exc:
        bench.check_base(base)
    assert str(base / "model.safetensors") in str(exc.value.code)
    assert "model_sha256" in str(exc.value.code)
    (base / "recipe.json").unlink()  # a base without a recipe has no recorded scores
    with pytest.raises(SystemExit, match="recipe.json: no readable recipe"):
        bench.check_base(base)


def test_the_study_refuses_a_base_below_its_bar_before_training(tmp_path):
    base, _ = _copy_base(tmp_path, stage0_heldout_128=0.047)
    proc = _quick(tmp_path / "accuracy.json", tmp_path / "runs", base, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "below its bar 0.9" in proc.stderr and str(base) in proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "accuracy.json").exists()


def test_every_variant_of_the_study_is_a_valid_config():
    """Each variant's overrides parse against the fine-tuning config (a static budget
    below DST's default floor must lower the floor with it)."""
    from sb_titan.config.toml import load_config

    for v in bench.variants(low=0.1, sweep=(0.5, 0.3)):
        config = load_config(bench.FINETUNE, list(v.overrides))
        assert load_config(bench.FINETUNE, v.attention).sparse_attention == config.sparse_attention
        if v.eval_budget is not None:
            assert config.dst.beta0 == v.eval_budget and config.sparse_attention.enabled


def test_per_document_budgets_are_paired_with_micro_batch_dst():
    """The report's Δ columns pair each variant with dense, SAB static and micro-batch
    SAB+DST on the seeds both have: here the per-document run recalls 13 of 128 items
    more than the micro-batch run at seed 0, so its Δ vs micro-batch is 13/128 exactly,
    and the row shows it."""
    rng = np.random.default_rng(1)
    distances = rng.integers(1, 4000, 128).tolist()
    micro = (rng.random(128) < 0.5).astype(float)
    per_doc = micro.copy()
    per_doc[np.flatnonzero(micro == 0)[:13]] = 1.0

    def run(name: str, seed: int, exact, sparse: bool) -> dict:
        scores = {"exact": list(exact), "em": float(np.mean(exact)), "loss": 5.0}
        scores["value_loss"] = 1.0
        series = {"density": [0.5], "recall": [0.9], "true_recall": [0.7], "top_key_hit": [0.9]}
        out = {"variant": name, "seed": seed, "distances": distances, "dense": scores}
        return out | {"sparse": scores, "series": series} if sparse else out | {"series": {}}

    results = {
        "settings": {
            "steps": 40,
            "config": "x.toml",
            "heldout": {"docs": 64, "lengths": [2048], "seed": 777},
        },
        "runs": {
            "dense/seed0": run("dense", 0, micro, False),
            "sab_dst_recall/seed0": run("sab_dst_recall", 0, micro, True),
            "sab_dst_recall/seed1": run("sab_dst_recall", 1, micro, True),  # unpaired seed
            "sab_dst_recall_doc/seed0": run("sab_dst_recall_doc", 0, per_doc, True),
        },
    }
    summary = bench.summarize(results, bench.variants(low=0.1, sweep=()))
    delta, lo, hi = summary["sab_dst_recall_doc"]["vs_sab_dst_recall"]
    assert delta == 13 / 128 and lo <= delta <= hi
    assert "vs_sab_dst_recall" not in summary["sab_dst_recall"]  # not with itself
    row = next(
        line for line in bench.markdown(results, summary).splitlines() if "per-document" in line
    )
    assert bench.fmt(summary["sab_dst_recall_doc"]["vs_sab_dst_recall"]) in row.split(" | ")[6]
