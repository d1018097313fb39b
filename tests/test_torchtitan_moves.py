"""What TorchTitan's main branch has already removed, the recipe does without.

Main dropped the `torchtitan.components.checkpoint` shim (pytorch/torchtitan#4184) and
replaced `torchtitan.components.dataloader` with Grain-based loaders (#4088). The
recipe reaches both through sb_titan/compat: the checkpoint manager from
`torchtitan.components.checkpointer`, the loader base class from main's
`torchtitan.components.data.loader`, 0.3.0's module, or TorchTitan's contract itself.
Here a child process makes both modules unimportable and uses the loader and the
checkpoint manager for real; a child with nothing hidden is the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, cpu_env

MOVED = ["torchtitan.components.checkpoint", "torchtitan.components.dataloader"]
WORKER = REPO / "tests" / "hidden_modules_worker.py"


def _run(hidden: list[str], dump) -> dict:
    env = cpu_env(PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(WORKER), ",".join(hidden), str(dump)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    base = tmp_path_factory.mktemp("moves")
    return _run([], base / "stock"), _run(MOVED, base / "hidden")


def test_the_hidden_modules_stay_unimported(runs):
    stock, hidden = runs
    assert hidden["hidden_imported"] == []
    assert stock["base"] != hidden["base"]  # the hidden run really took another path
    assert hidden["base"] == "sb_titan.compat.data._ProtocolBase"


def test_the_loader_keeps_the_trainer_contract_and_its_batches(runs):
    stock, hidden = runs
    assert stock["contract"] == hidden["contract"] == [True, True, True]
    assert hidden["batches"] == stock["batches"]
    assert hidden["resume_matches"] and stock["resume_matches"]


def test_the_checkpoint_manager_saves_purges_loads_and_refuses(runs):
    for run in runs:
        assert run["saved"] == [True] * 4
        # keep_latest_k = 2: step-1 goes once step-3 is complete (the save of step-4)
        assert run["folders"] == ["step-2", "step-3", "step-4"]
        assert all(run["manifests"])
        assert run["loaded"] and run["weights_restored"]
        assert "checkpoint step 4 is corrupted" in run["refused"], run["refused"]
        assert "__0_0.distcp" in run["refused"]
