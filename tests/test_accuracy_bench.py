"""bench/accuracy.py: `--quick` fine-tunes the pretrained base (2 variants, real torchrun) and
scores it; the bootstrap intervals behave as intervals. No accuracy figure of the full
study is asserted here; the base must recall within its pretraining context."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cpu_env

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


def _random_base(path):
    """A randomly initialised base in the pretrained base's format (sb-export's files)."""
    from sb_titan.data.tokenizer import TOKENIZER_DIR
    from sb_titan.eval.checkpoint import load_from_config
    from sb_titan.tools.export import export_folder

    tokenizer = ["--hf_assets_path", str(TOKENIZER_DIR)]  # the bundled one, as the base's
    return export_folder(load_from_config(None, bench.FINETUNE, "dense", tokenizer), path)


def test_quick_study_fine_tunes_the_base_and_scores_it(tmp_path):
    """With the base `pretrain` made when there is one (then it must still recall), else
    with a random base of the same shape (the pipeline only)."""
    pretrained = (bench.BASE / "model.safetensors").is_file()
    base = bench.BASE if pretrained else _random_base(tmp_path / "base")
    out = tmp_path / "accuracy.json"
    proc = _quick(out, tmp_path / "runs", base, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["base_sha256"] == bench.sha256(base / "model.safetensors")
    runs = result["runs"]
    assert set(runs) == {"dense/seed0", "sab_dst_recall/seed0"}
    for run in runs.values():
        assert len(run["series"]["loss"]) == 3
        assert len(run["dense"]["exact"]) == len(run["distances"]) > 0
    sparse = runs["sab_dst_recall/seed0"]
    assert len(sparse["series"]["density"]) == 3 and sparse["sparse"]["budget"] == 0.9
    assert "sparse" not in runs["dense/seed0"]
    assert "budget_mean" not in runs["dense/seed0"]["series"]  # no budget applies to dense
    if pretrained:  # fine-tuning started from the base, not from a random init: it recalls
        assert runs["dense/seed0"]["dense"]["em"] >= 0.3
    # resumable: a second invocation finds every run done and trains nothing
    again = _quick(out, tmp_path / "runs", base, timeout=120)
    assert again.returncode == 0 and "[1/2]" not in again.stdout
    assert json.loads(out.read_text())["runs"] == runs


def test_pretrain_runs_its_stages_in_order_and_exports_the_last(tmp_path, monkeypatch):
    """Two tiny stages: the second starts from the first's final weights; the base is the
    second's model, exported with the recipe (command, stages, held-out scores, sha256)."""
    import argparse

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stages = (bench.Stage(128, 32, 4, rows=2, steps=3), bench.Stage(256, 64, 4, rows=1, steps=2))
    monkeypatch.setattr(bench, "STAGES", stages)
    monkeypatch.setattr(bench, "BASE", tmp_path / "base")
    bench.pretrain(argparse.Namespace(root=str(tmp_path / "runs")))
    first = tmp_path / "runs" / "pretrain" / "stage0_128" / "checkpoint" / "step-3"
    second_log = (tmp_path / "runs" / "pretrain" / "stage1_256" / "train.log").read_text()
    assert f"Loading the checkpoint from {first}" in second_log
    recipe = json.loads((tmp_path / "base" / "recipe.json").read_text())
    assert [s["seq_len"] for s in recipe["stages"]] == [128, 256]
    assert set(recipe) >= {"stage0_heldout_128", "stage1_heldout_256", "model_sha256"}
    assert recipe["model_sha256"] == bench.sha256(tmp_path / "base" / "model.safetensors")


def test_every_variant_of_the_study_is_a_valid_config():
    """Each variant's overrides parse against the fine-tuning config (a static budget
    below DST's default floor must lower the floor with it)."""
    from sb_titan.config.toml import load_config

    for v in bench.variants(low=0.1, sweep=(0.5, 0.3)):
        config = load_config(bench.FINETUNE, list(v.overrides))
        if v.eval_budget is not None:
            assert config.dst.beta0 == v.eval_budget and config.sparse_attention.enabled
