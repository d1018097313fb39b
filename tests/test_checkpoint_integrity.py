"""Checkpoint integrity (sb_titan/runtime/checkpoint.py): manifests written last,
verified before DCP loads; corrupted, truncated or incomplete checkpoints are refused
with one line naming the file and step, or skipped with a warning when asked."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEBUG_TOML, REPO, TINY, cpu_env, losses, scalars, torchrun

from sb_titan.config.toml import load_config
from sb_titan.eval.checkpoint import load_from_config
from sb_titan.runtime.checkpoint import (
    MANIFEST,
    CheckpointIntegrityError,
    check_checkpoint_folder,
    choose_step,
    finalize,
    verify,
)


# -- synthetic folders (no torchrun) ------------------------------------------------------------
def _fake_step(folder: Path, step: int, marker: bool = True) -> Path:
    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta" * 10)
    for r in range(2):
        (d / f"__{r}_0.distcp").write_bytes(bytes(range(256)) * (40 + r))
    if marker:
        finalize(d)
    return d


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_and_verifies(tmp_path):
    d = _fake_step(tmp_path, 4)
    files = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert files["__1_0.distcp"]["bytes"] == 256 * 41
    verify(d)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            lambda d: _flip(d / "__1_0.distcp"),
            "checkpoint step 4 is corrupted: {d}/__1_0.distcp has",
        ),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
            "checkpoint step 4 is corrupted: {d}/__0_0.distcp has 100 bytes",
        ),
        (
            lambda d: (d / ".metadata").unlink(),
            "checkpoint step 4 is corrupted: {d}/.metadata is missing",
        ),
        (
            lambda d: (d / MANIFEST).unlink(),
            f"checkpoint step 4 is incomplete: {{d}}/{MANIFEST} is missing",
        ),
        (
            lambda d: (d / "__2_0.distcp").write_bytes(b"x"),
            f"{{d}}/__2_0.distcp is not in {MANIFEST}",
        ),
        (lambda d: (d / MANIFEST).write_text("{"), f"unreadable {{d}}/{MANIFEST}"),
    ],
    ids=["bitflip", "truncated", "missing_file", "no_marker", "unlisted", "bad_manifest"],
)
def test_damage_is_refused_naming_file_and_step(tmp_path, damage, expected):
    d = _fake_step(tmp_path, 4)
    damage(d)
    with pytest.raises(CheckpointIntegrityError) as e:
        verify(d)
    msg = str(e.value)
    assert "\n" not in msg and expected.format(d=d) in msg, msg


def test_checksums_are_split_over_ranks(tmp_path):
    d = _fake_step(tmp_path, 4)
    _flip(d / "__1_0.distcp")
    verify(d, rank=0, world=2)  # rank 0 checksums .metadata and its own file only
    with pytest.raises(CheckpointIntegrityError, match="__1_0.distcp"):
        verify(d, rank=1, world=2)
    verify(d, checksums=False)  # sizes alone cannot see a flip


def test_choose_step_newest_refuses_or_falls_back(tmp_path):
    _fake_step(tmp_path, 2)
    _flip(_fake_step(tmp_path, 4) / "__0_0.distcp")
    _fake_step(tmp_path, 6, marker=False)  # a save that died: no marker
    with pytest.raises(
        CheckpointIntegrityError, match="step 6 is incomplete.*fallback_to_previous"
    ):
        choose_step(tmp_path, -1, fallback=False, allow_unverified=False, check=verify)
    step, warning = choose_step(tmp_path, -1, fallback=True, allow_unverified=False, check=verify)
    assert (
        step == 2 and "step 6 is incomplete" in warning and "loading checkpoint step 2" in warning
    )
    (tmp_path / "step-2" / MANIFEST).unlink()
    with pytest.raises(
        CheckpointIntegrityError, match="step 4 is corrupted.*no earlier checkpoint"
    ):
        choose_step(tmp_path, 4, fallback=True, allow_unverified=False, check=verify)


def test_allow_unverified_loads_old_checkpoints_with_a_note(tmp_path):
    _fake_step(tmp_path, 2, marker=False)
    step, note = choose_step(tmp_path, -1, fallback=False, allow_unverified=True, check=verify)
    assert step == 2 and "unverified" in note
    (tmp_path / "step-2" / ".metadata").unlink()  # not even DCP-complete: still refused
    with pytest.raises(CheckpointIntegrityError, match="incomplete"):
        choose_step(tmp_path, -1, fallback=False, allow_unverified=True, check=verify)


def _config(dump: Path, *extra: str):
    return load_config(DEBUG_TOML, ["--dump_folder", str(dump), "--checkpoint.enable", *extra])


def test_launch_check(tmp_path):
    check_checkpoint_folder(_config(tmp_path))  # nothing to resume: fine
    d = _fake_step(tmp_path / "checkpoint", 4)
    check_checkpoint_folder(_config(tmp_path))
    _flip(d / "__0_0.distcp")
    with pytest.raises(CheckpointIntegrityError, match="step 4 is corrupted.*__0_0.distcp"):
        check_checkpoint_folder(_config(tmp_path))
    check_checkpoint_folder(_config(tmp_path, "--checkpoint.no-verify_before_launch"))
    with pytest.raises(CheckpointIntegrityError, match="load_step = 3.*does not exist"):
        check_checkpoint_folder(_config(tmp_path / "none", "--checkpoint.load_step", "3"))


# -- real torchrun runs --------------------------------------------------------------------------
def _ckpt(*args: str) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.interval", "2", *args]


def _entry(dump: Path, *args: str) -> list[str]:
    """`python -m sb_titan.tools.train` arguments, as conftest.torchrun passes them."""
    return ["--config_file", str(DEBUG_TOML), "--dump_folder", str(dump), *TINY, *_ckpt(*args)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """4 steps on 2 ranks; step-2 saved asynchronously (its manifest comes when the
    step-4 save waits for it), step-4 synchronously (the last step)."""
    dump = tmp_path_factory.mktemp("trained")
    args = ["--training.steps", "4", "--checkpoint.async_mode", "async"]
    torchrun(2, _ckpt(*args), dump)
    return dump


def _resume_copy(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained / "checkpoint", dest / "checkpoint")
    return dest


@pytest.mark.torchrun
def test_saves_get_manifests_written_last(trained):
    for step in (2, 4):
        d = trained / "checkpoint" / f"step-{step}"
        files = json.loads((d / MANIFEST).read_text())["files"]
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files), files
        verify(d)


@pytest.mark.torchrun
def test_flipped_bytes_stop_the_resume_before_any_step(trained, tmp_path):
    dump = _resume_copy(trained, tmp_path)
    bad = dump / "checkpoint" / "step-4" / "__1_0.distcp"
    _flip(bad)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = _run(
        [
            *launcher,
            "--nproc_per_node=2",
            "-m",
            "sb_titan.tools.train",
            *_entry(dump, "--training.steps", "6"),
        ]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("sb_titan: checkpoint error:")]
    assert len(lines) == 1, out[-4000:]  # one line, from rank 0
    assert f"checkpoint step 4 is corrupted: {bad} has xxh3_64" in lines[0]
    assert "Training starts" not in out and not scalars(dump, "loss_metrics/global_avg_loss")
    # The launcher's check (run_train.sh runs it before torchrun) says the same.
    check = _run([sys.executable, "-m", "sb_titan.tools.train", "--check-config", *_entry(dump)])
    assert check.returncode == 2 and f"checkpoint step 4 is corrupted: {bad}" in check.stderr
    # So do sb-export / sb-eval, which load the weights without the trainer.
    with pytest.raises(CheckpointIntegrityError, match="step 4 is corrupted.*__1_0.distcp"):
        load_from_config(dump / "checkpoint" / "step-4", DEBUG_TOML)


@pytest.mark.torchrun
def test_fallback_resumes_from_previous_checkpoint(trained, tmp_path):
    dump = _resume_copy(trained, tmp_path)
    bad = dump / "checkpoint" / "step-4" / "__0_0.distcp"
    bad.write_bytes(bad.read_bytes()[:1000])  # truncated
    proc = torchrun(2, _ckpt("--training.steps", "4", "--checkpoint.fallback_to_previous"), dump)
    out = proc.stdout + proc.stderr
    assert f"checkpoint step 4 is corrupted: {bad} has 1000 bytes" in out
    assert "loading checkpoint step 2 instead" in out and "Training starts at step 3" in out
    # Steps 3 and 4 retrained from the async-saved step 2 match the original run, and
    # the new step-4 checkpoint verifies.
    resumed, original = scalars(dump, "loss_metrics/global_avg_loss"), losses(trained)
    assert sorted(resumed) == [3, 4]
    assert max(abs(resumed[s] - original[s - 1]) for s in (3, 4)) <= 1e-5, (resumed, original)
    verify(dump / "checkpoint" / "step-4")
