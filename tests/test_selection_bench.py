"""bench/selection.py --quick: every estimator family and policy through the whole
accuracy base at one density, rows appended as measured and a rerun resuming (both
runs the bench's `main` in this process: its import is this module's)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("selection_bench", REPO / "bench" / "selection.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
BASE = REPO / "bench" / "accuracy_base" / "model.safetensors"


@pytest.mark.skipif(not BASE.exists(), reason="the accuracy base is not in this checkout")
def test_selection_quick_measures_every_method_and_resumes(tmp_path, keep_torch_threads):
    out = tmp_path / "selection.jsonl"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    base = {(r["scorer"], r["policy"]): r for r in rows if r["input"] == "base"}
    methods = {(s, "topk") for s in ("mean", "int4_max", "kmax", "pool8_max", "exact", "exact_max")}
    assert methods | {("mean", "mass"), ("int4_max", "mass"), ("dense", "-")} == set(base)
    topk = [base[m] for m in methods]
    # topk keeps ceil(beta * n) blocks whatever ranks them: one density for every scorer
    assert len({round(r["density"], 9) for r in topk}) == 1 and topk[0]["density"] < 0.5
    for r in topk:
        assert 0 < r["true_recall"] < 1 and 0 < r["top_key_hit"] <= 1, r
        assert r["recalls"] > 0 and 0 <= r["exact_match"] <= 1
    # the oracle keeps the most true mass (up to the sampled queries' spread)
    assert base[("exact", "topk")]["true_recall"] >= base[("mean", "topk")]["true_recall"] - 0.01
    dense = base[("dense", "-")]
    assert dense["density"] == 1.0 and dense["true_recall"] is None  # nothing to sample
    assert {r["scorer"] for r in rows if r["input"] == "synthetic"} >= {"mean", "int4_max"}
    # a rerun skips every row already measured
    assert bench.main(["--quick", "--out", str(out)]) == 0
    assert out.read_text().count("\n") == len(rows)
