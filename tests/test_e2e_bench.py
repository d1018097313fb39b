"""bench/e2e.py's load record: what else shared the CPUs during a run is measured, and
a row taken under load is flagged. No timing is asserted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("e2e_bench", REPO / "bench" / "e2e.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux /proc/stat")
def test_other_work_during_a_run_is_counted():
    """A run that sleeps beside a process burning CPU: the burner's CPU is other work."""
    other = subprocess.Popen([sys.executable, "-c", BURN.format(3.0)])
    try:
        _, load = bench.run_watching_load(["sleep", "1.5"], dict(os.environ))
    finally:
        other.wait()
    assert load["other_cpu_share"] > 0.1
    assert {"load_before", "load_1min"} <= set(load)


def test_the_runs_own_cpu_is_not_other_work(monkeypatch):
    """Machine busy 4 s, of which the run's own processes 3 s, over 2 s on 2 cores: other
    work took 1 of 4 CPU seconds."""
    busy, own, clock = iter([100.0, 104.0]), iter([10.0, 13.0]), iter([50.0, 52.0])
    monkeypatch.setattr(bench, "_machine_busy_s", lambda: next(busy))
    monkeypatch.setattr(bench, "_children_cpu_s", lambda: next(own))
    monkeypatch.setattr(bench.time, "time", lambda: next(clock))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    _, load = bench.run_watching_load(["true"], dict(os.environ))
    assert load["other_cpu_share"] == pytest.approx(0.25)


def test_rows_under_load_are_flagged():
    row = {"other_cpu_max": 0.25}
    assert "under load" in bench._other_cpu(row)
    assert "under load" not in bench._other_cpu({"other_cpu_max": 0.02})
    assert "under load" not in bench._other_cpu({})  # recorded before it was measured
