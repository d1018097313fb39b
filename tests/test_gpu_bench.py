"""bench/gpu.py --dry-run: the GPU benchmark's code path at tiny shapes on the CPU
(Triton interpreter), so the script a person with a GPU runs first keeps working; and
its rate arithmetic, which only a GPU run would otherwise exercise, on given times."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO, cpu_env

_spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def test_gpu_bench_dry_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/gpu.py", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_dry_run.json").read_text())
    assert report["dry_run"] and "Triton interpreter" in report["device"]
    checks = report["correctness"]
    assert checks and all(r["ok"] for r in checks)
    fp32 = [r for r in checks if r["dtype"] == "torch.float32"]
    assert fp32 and all(max(r["max_abs_error"].values()) < 1e-4 for r in fp32)  # upcast dots
    # the `flex` backend on the same tables: forward only on CPU (no CPU backward)
    assert all(r["flex_ok"] and set(r["flex_max_abs_error"]) == {"out"} for r in fp32)
    assert all(r["flex_max_abs_error"]["out"] < 1e-4 for r in fp32)
    # bf16 runs both checks (its numerics only mean something on a GPU)
    assert {r["check"] for r in checks if r["dtype"] == "torch.bfloat16"} == {
        "vs fp32",
        "vs dense",
    }
    speed = report["speed"]
    assert {r["density"] for r in speed} == {1.0, 0.5, 0.3, 0.1}
    assert all(r["block_pairs"] > 0 and r["triton_fwd_ms"] is None for r in speed)
    for key in ("fwd_ms", "preprocess_ms", "dq_ms", "dkdv_ms", "fwd_vs_dense", "bwd_vs_flex"):
        assert all(key in r for r in speed), key  # each kernel ran through its launcher
    assert any(r["dkdv_split_blocks"] > 0 for r in speed)  # the partial reduce ran too
    assert next(r for r in speed if r["density"] == 1.0)["block_pairs"] == speed[0]["full_pairs"]
    assert all("flex_error" not in r for r in speed)  # the BlockMask was built
    assert [d["kernel"] for d in report["dense"]] == ["torch"]
    assert report["goal"]["met"] == {"fwd": None, "bwd": None}  # nothing timed
    # (c) cannot run without a GPU; its variants load and pass the launch checks
    assert report["train_step"] == {
        "checked": ["dense", "dense_compiled", "sparse", "sparse_compiled", "sparse_flex"]
    }
    assert "| L | heads | block | dtype |" in proc.stdout


def test_rates_from_given_times():
    """Per-pair TFLOP/s and the goal columns, by hand: Bs = D = 64 (Bs^2 D = 2^18)."""
    row = {
        "block_pairs": 1000,
        "full_pairs": 4000,
        "fwd_ms": 2.0,
        "preprocess_ms": 0.5,
        "dq_ms": 1.0,
        "dkdv_ms": 1.5,
        "preprocess_bytes": 1e6,
        "dense_fwd_ms": 4.0,
        "dense_fwd_bwd_ms": 14.0,
        "flex_fwd_ms": 3.0,
        "flex_fwd_bwd_ms": 9.0,
    }
    r = gpu.rates(row, 64, 64)
    unit = 64**3 * 1000 / 1e9  # one pair per ms -> TFLOP/s per FLOP of Bs^2 D
    assert r["fwd_tflops_per_pair"] == pytest.approx(4 * unit / 2.0)
    assert r["bwd_ms"] == 3.0 and r["bwd_tflops_per_pair"] == pytest.approx(10 * unit / 3.0)
    assert r["dq_tflops_per_pair"] == pytest.approx(6 * unit / 1.0)
    assert r["dkdv_tflops_per_pair"] == pytest.approx(8 * unit / 1.5)
    assert r["preprocess_gb_per_s"] == pytest.approx(2.0)
    # per pair: ours 1000 pairs in 2 ms vs dense 4000 pairs in 4 ms -> 0.5
    assert r["fwd_vs_dense"] == pytest.approx(0.5)
    assert r["bwd_vs_dense"] == pytest.approx((1000 / 3.0) / (4000 / 10.0))
    # Flex computes the same pairs: the ratio is one of times
    assert r["fwd_vs_flex"] == pytest.approx(3.0 / 2.0)
    assert r["bwd_vs_flex"] == pytest.approx(6.0 / 3.0)
    missing = gpu.rates({"block_pairs": 1, "full_pairs": 1, "fwd_ms": None}, 64, 64)
    assert missing["fwd_tflops_per_pair"] is None and missing["fwd_vs_dense"] is None


def test_goal_at_density_point_one():
    rows = [
        {"density": 0.1, "fwd_vs_dense": 0.7, "bwd_vs_dense": 0.5},
        {"density": 0.1, "fwd_vs_dense": 0.65, "bwd_vs_dense": 0.9},
        {"density": 0.5, "fwd_vs_dense": 0.1, "bwd_vs_dense": 0.1},
    ]
    assert gpu.goal(rows)["met"] == {"fwd": True, "bwd": False}
