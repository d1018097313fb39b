"""bench/gpu.py --dry-run: the GPU benchmark's code path at tiny shapes on the CPU
(Triton interpreter), so the script a person with a GPU runs first keeps working."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, cpu_env


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
    assert all(max(r["max_abs_error"].values()) < 1e-4 for r in checks)  # fp32, upcast dots
    # the `flex` backend on the same table: forward only on CPU (no CPU backward)
    assert all(r["flex_ok"] and set(r["flex_max_abs_error"]) == {"out"} for r in checks)
    assert all(r["flex_max_abs_error"]["out"] < 1e-4 for r in checks)
    densities = {r["density"] for r in report["speed"]}
    assert densities == {1.0, 0.5, 0.25, 0.1}
    assert all(r["block_pairs"] > 0 and r["triton_fwd_ms"] is None for r in report["speed"])
    assert all("dq_ms" in r and "dkdv_ms" in r for r in report["speed"])  # per-kernel split ran
    # (c) cannot run without a GPU; its variants load and pass the launch checks
    assert report["train_step"] == {
        "checked": ["dense", "dense_compiled", "sparse", "sparse_compiled", "sparse_flex"]
    }
    assert "| L | heads | block | dtype |" in proc.stdout
