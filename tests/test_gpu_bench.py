"""bench/gpu.py, what a person with a GPU runs first, kept runnable without one.

One child process does what the GPU machine will (it has torch, Triton and numpy, and
nothing installed): an interpreter started with -S, so no .pth file runs (the editable
install's finder among them), sys.path = the checkout + the site-packages holding
torch, and torchtitan / torchdata / tensorboard made unimportable. In it, pytest
collects tests/test_kernels.py, then `bench/gpu.py --dry-run --quick` runs at tiny
shapes on the CPU (Triton interpreter) with a row cap. The rest runs in-process on
given rows, times and clocks: the budget, Flex failures, the rate arithmetic, the report.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cpu_env

_spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)
import gpu_rows  # noqa: E402  (bench/ is on sys.path once gpu.py is loaded)

BLOCKED = ("torchtitan", "torchdata", "tensorboard")
MAX_ROWS = 10  # of the dry run's 11: (a) 3, peers 2, (b) 2, Flex 2, (c) 2
# The child: nothing but the checkout and torch's site-packages on sys.path; BLOCKED
# raise on import; pytest collects the kernel tests, then bench/gpu.py runs.
BOOT = """
import importlib.abc, json, runpy, sys
sys.path[:] = {path!r} + [p for p in sys.path if "site-packages" not in p]
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"{{name}} is blocked here", name=name)
sys.meta_path.insert(0, Blocked())
import pytest
collect = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py"])
print("COLLECT", json.dumps({{"rc": int(collect), "editable": [
    m for m in sys.modules if "editable" in m]}}), flush=True)
sys.argv = ["bench/gpu.py", *{argv!r}]
try:
    runpy.run_path("bench/gpu.py", run_name="__main__")
except SystemExit as e:
    print("GPU", e.code, flush=True)
"""


def _site_dirs() -> list[str]:
    import numpy
    import triton

    return sorted({str(Path(m.__file__).resolve().parents[1]) for m in (torch, triton, numpy)})


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    argv = ["--dry-run", "--quick", "--parts", "a,b,flex,c", "--max-rows", str(MAX_ROWS)]
    argv += ["--out", str(out)]
    boot = BOOT.format(path=[str(REPO), *_site_dirs()], blocked=BLOCKED, argv=argv)
    env = cpu_env()
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-S", "-c", boot],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "stdout": proc.stdout,
        "collect": json.loads(next(x for x in lines if x.startswith("COLLECT "))[8:]),
        "gpu_rc": next(x for x in lines if x.startswith("GPU ")).split()[1],
        "path": out / "gpu_dry_run.jsonl",
    }


def test_kernel_tests_collect_without_torchtitan(isolated):
    assert isolated["collect"] == {"rc": 0, "editable": []}
    assert (
        "test_on_gpu" in isolated["stdout"]
        and "test_attention_matches_reference" in (isolated["stdout"])
    )


def test_dry_run_from_a_bare_checkout(isolated, capsys):
    assert isolated["gpu_rc"] == "0", isolated["stdout"][-3000:]
    rows = gpu_rows.read_rows([isolated["path"]])
    run, end = rows[0], rows[-1]
    assert run["part"] == "run" and "Triton interpreter" in run["device"]
    assert run["env"]["sb_titan_kernels"] == str(REPO / "kernels")  # the source tree's
    assert end == end | {"part": "end", "reason": "max_rows", "rows": MAX_ROWS}
    measured = rows[1:-1]
    assert len(measured) == MAX_ROWS
    assert not [r for r in measured if "error" in r]
    assert [r["part"] for r in measured] == ["a"] * 3 + ["peer"] * 2 + ["b"] * 2 + ["flex"] * 2 + [
        "c"
    ]
    checks = measured[:3]
    assert all(r["ok"] and r["finite"] for r in checks)
    assert all(r["deterministic"] for r in checks if r["check"] == "vs fp32")
    fp32 = next(r for r in checks if r["dtype"] == "torch.float32")
    assert max(fp32["rel_norm_error"].values()) < 1e-5  # the interpreter's upcast dots
    assert [r["check"] for r in checks if r["dtype"] == "torch.bfloat16"] == ["vs fp32", "vs flash"]
    peers = measured[3:5]
    assert {p["peer_key"] for p in peers} == {"flash", "cudnn"}
    assert all("error" not in p and p["fwd_ms"] is None for p in peers)  # ran, untimed
    speed = measured[5:7]
    assert [r["density"] for r in speed] == [1.0, 0.1]
    assert speed[0]["block_pairs"] == speed[0]["full_pairs"] > speed[1]["block_pairs"]
    assert all(r["fwd_ms"] is None and "dkdv_ms" in r for r in speed)
    assert any(r["dkdv_split_blocks"] > 0 for r in speed)  # the partial reduce ran too
    flex = measured[7:9]
    assert all("error" not in r for r in flex), flex
    assert all(r["rel_norm_vs_ours"]["out"] < 1e-5 for r in flex)  # same table, same scale
    stack = measured[9]
    assert stack["variant"] == "sparse" and stack["ran"].startswith("layer stack")
    assert "error" not in stack and "torchtitan" in stack["torchtitan"]  # why it fell back
    # `bench/gpu.py report` turns the JSONL back into the tables
    assert gpu.main(["report", str(isolated["path"])]) == 0
    text = capsys.readouterr().out
    assert "torch's bundled flash (FA2-class, not FA3)" in text and "stopped: max_rows" in text
    assert text.count("| 256 | (2, 1, 64) |") == MAX_ROWS - 1  # every row but (c)'s


def test_budget_stops_between_rows_and_keeps_them(tmp_path):
    """An injected clock: each Flex row takes 30 s; with 100 s the third row still fits
    (60 + 30 <= 100), the fourth would not (90 + 30 > 100) and never starts."""
    now = [0.0]
    started = []

    def measure(L, h, b, rho, *_):
        started.append(rho)
        now[0] += 30.0
        return {"fwd_ms": 1.0}

    grid = gpu.GRIDS["dry"] | {"densities": [1.0, 0.5, 0.3, 0.1, 0.05]}
    log = gpu_rows.RowLog(tmp_path / "rows.jsonl", budget_s=100, clock=lambda: now[0])
    part = gpu.part_flex(grid, torch.device("cpu"), {}, measure=measure)
    assert gpu_rows.run_rows(log, [part]) == "budget"
    rows = gpu_rows.read_rows([tmp_path / "rows.jsonl"])
    assert started == [1.0, 0.5, 0.3]
    assert [r["density"] for r in rows[:-1]] == [1.0, 0.5, 0.3]
    assert rows[-1] == rows[-1] | {"part": "end", "reason": "budget", "rows": 3}


def test_a_flex_failure_is_a_row(tmp_path):
    def measure(*_):
        raise RuntimeError("no valid config for block 64")

    log = gpu_rows.RowLog(tmp_path / "rows.jsonl")
    part = gpu.part_flex(gpu.GRIDS["dry"], torch.device("cpu"), {}, measure=measure)
    assert gpu_rows.run_rows(log, [part]) == "done"
    rows = gpu_rows.read_rows([tmp_path / "rows.jsonl"])
    flex = [r for r in rows if r["part"] == "flex"]
    assert len(flex) == 2 and all("no valid config" in r["error"] for r in flex)
    assert gpu.exit_code(rows) == 0
    assert gpu.exit_code(rows + [{"part": "a", "ok": False}]) == 1
    assert gpu.exit_code(rows + [{"part": "a", "error": "OutOfMemoryError"}]) == 1
    assert "RuntimeError: no valid config" in gpu_rows.markdown(rows)


def test_train_variants_pass_the_launch_checks():
    pytest.importorskip("torchtitan")
    import gpu_train

    assert gpu_train.check_train_variants() == {"checked": sorted(gpu_train.TRAIN_VARIANTS)}


def test_rates_from_given_times():
    """Per-pair TFLOP/s and the ratios, by hand: Bs = D = 64 (Bs^2 D = 2^18)."""
    row = {
        "block_pairs": 1000,
        "full_pairs": 4000,
        "fwd_ms": 2.0,
        "preprocess_ms": 0.5,
        "dq_ms": 1.0,
        "dkdv_ms": 1.5,
        "preprocess_bytes": 1e6,
        "flash_fwd_ms": 4.0,
        "flash_bwd_ms": 10.0,
        "cudnn_fwd_ms": 2.0,
        "cudnn_bwd_ms": None,
    }
    r = gpu.rates(row, 64, 64)
    unit = 64**3 * 1000 / 1e9  # one pair per ms -> TFLOP/s per FLOP of Bs^2 D
    assert r["fwd_tflops_per_pair"] == pytest.approx(4 * unit / 2.0)
    assert r["bwd_ms"] == 3.0 and r["bwd_tflops_per_pair"] == pytest.approx(10 * unit / 3.0)
    assert r["dq_tflops_per_pair"] == pytest.approx(6 * unit / 1.0)
    assert r["dkdv_tflops_per_pair"] == pytest.approx(8 * unit / 1.5)
    assert r["preprocess_gb_per_s"] == pytest.approx(2.0)
    # peers per pair of the full table: flash 4000 pairs in 4 ms vs ours 1000 in 2 ms
    assert r["flash_fwd_tflops_per_pair"] == pytest.approx(4 * unit * 4 / 4.0)
    assert r["fwd_vs_flash"] == pytest.approx(0.5)
    assert r["bwd_vs_flash"] == pytest.approx((1000 / 3.0) / (4000 / 10.0))
    assert r["fwd_vs_cudnn"] == pytest.approx(0.25)
    assert r["cudnn_bwd_tflops_per_pair"] is None and r["bwd_vs_cudnn"] is None
    missing = gpu.rates({"block_pairs": 1, "full_pairs": 1, "fwd_ms": None}, 64, 64)
    assert missing["fwd_tflops_per_pair"] is None and missing["fwd_vs_flash"] is None


def test_goal_at_density_point_one():
    rows = [
        {"density": 0.1, "fwd_vs_flash": 0.7, "bwd_vs_flash": 0.5},
        {"density": 0.1, "fwd_vs_flash": 0.65, "bwd_vs_flash": 0.9},
        {"density": 0.5, "fwd_vs_flash": 0.1, "bwd_vs_flash": 0.1},
    ]
    assert gpu.goal(rows)["met"] == {"fwd": True, "bwd": False}
