"""The command line answers at once and in one line: every tool's --help loads neither
torch nor TorchTitan; a bad key, an empty or odd input, missing LongBench files are
one line on stderr naming the thing. (Timings are bench/cli.py's, not a test's.)"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO, cpu_env

from sb_titan.config import cli

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("torch", "torchtitan")


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=cpu_env(**env)
    )


def _imported(stderr: str) -> set[str]:
    """Top-level packages a process imported (PYTHONPROFILEIMPORTTIME's report)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def _script(entry: str, *args: str) -> list[str]:
    """What the installed console script runs, run from this checkout."""
    module, func = entry.split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code, *args]


@pytest.mark.parametrize(
    "cmd",
    [
        *[pytest.param(_script(e, "--help"), id=name) for name, e in SCRIPTS.items()],
        pytest.param(_script(SCRIPTS["sb-eval"], "longbench", "--help"), id="sb-eval-longbench"),
        pytest.param(["./run_train.sh", "--help"], id="run_train.sh"),
    ],
)
def test_help_loads_neither_torch_nor_torchtitan(cmd):
    proc = _run(cmd, PYTHONPROFILEIMPORTTIME="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    imported = _imported(proc.stderr)
    assert "argparse" in imported or "sb_titan" in imported  # the report is there
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_run_train_sh_help_lists_its_environment():
    proc = _run(["./run_train.sh", "--help"])
    for var in ("CONFIG_FILE", "NGPU", "NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT"):
        assert f"\n  {var} " in proc.stdout, var
    for var in ("MAX_RESTARTS", "LOG_RANK", "SB_TORCH_SPEC"):
        assert f"\n  {var} " in proc.stdout, var
    assert "usage: sb-train --config X.toml" in proc.stdout and "--help-all" in proc.stdout


def test_bad_key_is_one_line_naming_it_and_the_close_one(tmp_path):
    """`./run_train.sh --check-config` checks in one process (no torchrun, no lock): a
    misspelt key is one line, not tyro's box listing every override."""
    proc = _run(["./run_train.sh", "--check-config", "--training.stepz", "3"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "unknown command-line key '--training.stepz'" in lines[0]
    assert "did you mean '--training.steps'?" in lines[0]
    assert "torchrun" not in proc.stdout + proc.stderr


@dataclasses.dataclass
class _Group:
    lr: float = 0.1


@dataclasses.dataclass
class _Training:
    steps: int = 1
    local_batch_size: int = 2
    enable_cpu_offload: bool = False


@dataclasses.dataclass
class _Config:
    """A config tree shaped like TorchTitan's: sections, a bool, a list of sections, a
    dict, a field hidden from the command line."""

    training: _Training = dataclasses.field(default_factory=_Training)
    groups: list = dataclasses.field(default_factory=lambda: [_Group()])
    extra: dict = dataclasses.field(default_factory=lambda: {"a": 1})
    dump_folder: str = "./outputs"
    model_spec: object = None


@pytest.mark.parametrize(
    "args",
    [
        ["--training.steps", "3"],
        ["--training.local-batch-size=4"],  # tyro's spelling and TorchTitan's
        ["--training.local_batch_size", "4"],
        ["--training.no-enable-cpu-offload"],
        ["--dump_folder", "x", "activation-checkpoint:full"],  # a subcommand is tyro's
        ["--groups.0.lr", "0.2"],  # below a list or a dict: tyro decides
        ["--extra.a", "2"],
        ["--help"],
    ],
)
def test_known_keys_pass(args):
    assert cli.unknown_key(_Config(), args) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stepz", "3"], "'--training.stepz' (did you mean '--training.steps'?)"),
        (["--training.steps", "1", "--lr", "1"], "'--lr' (did you mean '--groups.0.lr'?)"),
        (["--training.no-steps"], "'--training.no-steps' (did you mean '--training.steps'?)"),
        (["--training", "3"], "'--training' (did you mean"),  # a section is not a key
        (["--model_spec", "x"], "'--model_spec'"),  # derived from [model], never set
        (["--zzzzzz"], "'--zzzzzz'"),
    ],
)
def test_unknown_keys_are_named(args, message):
    got = cli.unknown_key(_Config(), args)
    assert got is not None and message in got, got
    if "did you mean" not in message:
        assert "did you mean" not in got


def test_tyro_complaint_is_cut_to_its_first_paragraph():
    box = (
        "╭─ Invalid choice ─────────────────────────────╮\n"
        "│ invalid choice 'bogus' for argument           │\n"
        "│ '--sab.policy'. Expected one of ('sab',       │\n"
        "│ 'tokens').                                    │\n"
        "│ ───────────────────────────────────────────── │\n"
        "│ For full helptext, run - --help               │\n"
        "╰───────────────────────────────────────────────╯\n"
    )
    assert cli.first_line(box) == (
        "invalid choice 'bogus' for argument '--sab.policy'. Expected one of ('sab', 'tokens')."
    )


def test_bad_values_are_one_line():
    """What tyro refuses after the keys pass: a value of the wrong type or choice."""
    from sb_titan.config.toml import ConfigError, load_config

    for args, needle in (
        (["--training.steps", "abc"], "Error parsing --training.steps: invalid literal"),
        (["--sparse_attention.policy", "bogus"], "invalid choice 'bogus'"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(REPO / "train_configs" / "debug_cpu.toml", args)
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_help_choices_are_the_librarys():
    """The tools name --help's choices themselves (their libraries load torch); they must
    stay the libraries' own."""
    from sb_titan.balance.cost_model import ANALYTIC_DEVICES
    from sb_titan.balance.cost_model.recall import RECALL_MEASURES
    from sb_titan.balance.dst import ANCHORS
    from sb_titan.models.flavors import FAMILY_FLAVORS
    from sb_titan.profiler.stage import SCOPES
    from sb_titan.profiler.timing import CLOCKS
    from sb_titan.simulator.cluster import SCHEDULES
    from sb_titan.simulator.step import BASELINE_POLICIES
    from sb_titan.tools import profile, simulate

    assert simulate.SCHEDULES == SCHEDULES and simulate.ANCHORS == ANCHORS
    assert simulate.DEVICES == tuple(sorted(ANALYTIC_DEVICES))
    assert simulate.FAMILIES == tuple(sorted(FAMILY_FLAVORS))
    assert simulate.BASELINE_POLICIES == BASELINE_POLICIES
    assert simulate.RECALL_MEASURES == RECALL_MEASURES
    assert profile.SCOPES == SCOPES and profile.CLOCKS == CLOCKS


def _prep(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sb_titan.tools.prep", *args]
    return _run([*cmd, "--out", str(tmp_path / "out"), "--quiet"])


def test_prep_names_an_empty_input(tmp_path):
    empty, good = tmp_path / "empty.jsonl", tmp_path / "good.jsonl"
    empty.write_text("")
    good.write_text(json.dumps({"text": "a whole document"}) + "\n")
    alone = _prep(tmp_path, "--input", str(empty))
    assert alone.returncode == 1
    assert alone.stderr.count("\n") == 1 and f"{empty}: empty (no records)" in alone.stderr
    beside = _prep(tmp_path, "--input", str(empty), str(good))  # noted, the rest written
    assert beside.returncode == 0
    assert beside.stderr == f"sb-prep: {empty}: empty (no records), skipped\n"
    assert "wrote 1 documents" in beside.stdout


def test_prep_names_an_odd_hub_record(tmp_path):
    """datasets streams a batch at a time and fails inside its iterator on a record
    whose fields differ from the first ones': one line naming where, no traceback."""
    data = tmp_path / "hub"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}))
    (data / "b.jsonl").write_text(json.dumps({"body": "three"}) + "\n")
    proc = _prep(tmp_path, "--hf-dataset", str(data))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{data}[train]:3: this record" in lines[0]
    assert "expected the string field 'text' in every record" in lines[0]


def test_longbench_files_are_checked_before_a_model_loads(tmp_path):
    (tmp_path / "trec.jsonl").write_text(
        json.dumps({"input": "q", "context": "c", "answers": ["a"]}) + "\nnot json\n"
    )
    base = [*_script(SCRIPTS["sb-eval"], "longbench"), "--hf", str(tmp_path / "no_model")]
    for tasks, needle in (
        ("hotpotqa,trec", f"not found: {tmp_path / 'hotpotqa.jsonl'}."),
        ("trec", f"{tmp_path / 'trec.jsonl'}:2: not JSON"),
    ):
        proc = _run([*base, "--data", str(tmp_path), "--tasks", tasks])
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], proc.stderr
        assert "huggingface.co/datasets/THUDM/LongBench" in lines[0]
    proc = _run([*base, "--data", str(tmp_path)], PYTHONPROFILEIMPORTTIME="1")
    assert "not found" in proc.stderr and not _imported(proc.stderr) & set(HEAVY)
