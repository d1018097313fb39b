"""Elastic recovery: run_train.sh restarts a job whose rank died, from its last checkpoint,
without a person; replayed steps are logged once; errors that would recur are not retried."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import REPO, TINY, cpu_env, indexed_args, losses, sample_log, torchrun

from sb_titan.config.toml import ConfigError, load_config
from sb_titan.data.indexed import IndexedWriter
from sb_titan.runtime import elastic
from sb_titan.runtime.tensorboard import RunTensorBoardLogger, read_scalars

LOSS = "loss_metrics/global_avg_loss"


def _steps_per_run(dump) -> dict[str, list[int]]:
    """Loss steps as TensorBoard itself shows them, per run folder (purges honoured)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for run in sorted((dump / "tb").iterdir()):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        out[run.name] = [e.step for e in acc.Scalars(LOSS)] if LOSS in acc.Tags()["scalars"] else []
    return out


# -- fast: the pieces ---------------------------------------------------------------------------
def test_tensorboard_restart_purges_replayed_steps(tmp_path, monkeypatch):
    """A restarted writer appends to the same run folder and hides the first attempt's
    steps from the resume point on, so TensorBoard shows every step once."""
    tb = tmp_path / "tb"
    first = RunTensorBoardLogger(tb)
    first.start(1)
    for step in (1, 2, 3):
        first.log({LOSS: float(step)}, step)  # flushed: survives the kill below
    first.writer = None  # killed: never closed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = RunTensorBoardLogger(tb)
    second.start(3)  # resumed from the step-2 checkpoint
    for step in (3, 4):
        second.log({LOSS: 10.0 * step}, step)
    second.close()
    assert _steps_per_run(tmp_path) == {next(tb.iterdir()).name: [1, 2, 3, 4]}
    assert read_scalars(tmp_path)[LOSS] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}


def test_step_log_truncated_to_resume_point(tmp_path):
    path = tmp_path / "samples_rank0.jsonl"
    lines = [json.dumps({"step": s, "microbatch": m}) for s in (1, 2, 3) for m in (0, 1)]
    path.write_text("\n".join(lines) + '\n{"step": 3, "micro')  # torn by a kill
    elastic.truncate_step_log(path, 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 1, 2, 2]


def test_restarts_without_checkpoints_warn():
    config = load_config(REPO / "train_configs" / "debug_cpu.toml")
    assert "checkpoint.enable is false" in elastic.restart_warning(config, 3)
    assert elastic.restart_warning(config, 0) is None
    config.checkpoint.enable = True
    assert elastic.restart_warning(config, 3) is None


def test_fatal_record_only_stops_later_attempts_of_the_same_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    elastic.record_failure(tmp_path, ConfigError("x.toml: bad key 'a.b'"))
    assert elastic.earlier_fatal(tmp_path) is None  # the attempt that failed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic.earlier_fatal(tmp_path) == "ConfigError: x.toml: bad key 'a.b'"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert elastic.earlier_fatal(tmp_path) is None  # a stale record of another job


# -- torchrun through run_train.sh ----------------------------------------------------------------
def _run_train(dump, *args: str, timeout: int = 600, **env: str):
    return subprocess.run(
        ["./run_train.sh", "--dump_folder", str(dump), *TINY, *args],
        cwd=REPO,
        env=cpu_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.torchrun
def test_non_retryable_error_is_not_retried(tmp_path):
    """A data error raised inside the ranks ends the job once with its cause, though
    restarts are allowed; restarts without checkpointing were warned about first. (A
    missing dataset never gets that far: the launch's check refuses it before any rank
    spawns, test_preflight.py.)"""
    # Tokens that pass the launch checks but changed since sb-prep wrote them (an id
    # flipped to another valid id): found by the rank that first reads their chunk, on
    # 2 ranks that each read only their own samples (one sample per chunk here).
    data, bad = tmp_path / "flipped", 10  # read by rank 1 at step 3
    writer = IndexedWriter(data, checksum_chunk_bytes=297 * 4)
    for _ in range(64):
        writer.add(np.arange(3, 300))
    writer.close({"source": "tests"})
    tokens = np.memmap(data / "tokens.bin", dtype="<u4", mode="r+")
    tokens[bad * 297 + 5] += 1
    tokens.flush()
    del tokens
    logged = ["--dataloader.sample_log"]
    proc = _run_train(tmp_path, *indexed_args(data), *logged, MAX_RESTARTS="2", NGPU="2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == elastic.NOT_RETRIED_EXIT, out[-4000:]
    assert "MAX_RESTARTS=2 but checkpoint.enable is false" in proc.stderr
    assert out.count("step:  1 ") == 1, out[-6000:]  # one attempt trained (rank 0's log)
    last = proc.stderr.strip().splitlines()[-1]
    chunk = f"chunk {bad} of 64 (bytes [{bad * 1188}, {(bad + 1) * 1188}))"
    assert last.startswith(f"sb_titan: not retried: ChecksumError: {data / 'tokens.bin'}: {chunk}")
    assert last.endswith("(rank 1, attempt 0)"), last
    # The steps before it trained on both ranks, never on the changed sample.
    assert sorted({r["step"] for r in sample_log(tmp_path, 1)}) == [1, 2]
    trained = [{p[0] for r in sample_log(tmp_path, rank) for row in r["rows"] for p in row}
               for rank in (0, 1)]  # fmt: skip
    assert trained[0] and trained[1] and not trained[0] & trained[1]
    assert bad not in trained[0] | trained[1]


@pytest.mark.torchrun
def test_a_failing_job_ends_with_its_cause_once(tmp_path):
    """An error restarts do not fix (here an injected one, on every attempt) is retried,
    and the job ends with the cause as one line: the line the launcher prints
    (`elastic.job_outcome`, wired into sb-launch as the test above shows) from what the
    last attempt's rank recorded. torchrun's agent and restarts run in this process."""
    proc = torchrun(
        1,
        ["--training.steps", "3"],
        tmp_path,
        check=False,
        max_restarts=1,
        rank_env={"SB_FAULT_RAISE_AT_STEP": "2"},
    )
    assert proc.returncode != 0
    code, last = elastic.job_outcome(tmp_path, proc.returncode)
    assert code == 1  # retried once: attempt 1
    assert last == "sb_titan: failed: RuntimeError: injected fault at step 2 (rank 0, attempt 1)"


@pytest.mark.torchrun
def test_killed_rank_resumes_bit_identical(tmp_path):
    """Rank 1 is SIGKILLed at the start of step 4 of 4 (checkpoint at step 2): torchrun
    restarts the job, which finishes on its own with the uninterrupted run's losses, bit
    for bit, and logs every step once (TensorBoard and the sample logs)."""
    common = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    common += ["--dataloader.sample_log"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    torchrun(2, common, straight)  # the reference: what run_train.sh trains, uninterrupted
    proc = _run_train(
        killed,
        *common,
        MAX_RESTARTS="2",
        NGPU="2",
        LOG_RANK="0,1",
        SB_FAULT_KILL_AT_STEP="4",
        SB_FAULT_KILL_RANK="1",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "fault injection: killing rank 1 at step 4" in out  # it did die and restart
    assert "Training starts at step 3" in out  # from the step-2 checkpoint
    assert losses(killed) == losses(straight) and len(losses(straight)) == 4
    assert not (killed / "sb_titan.lock").exists()  # the restart kept it, the end released it
    (steps,) = _steps_per_run(killed).values()  # one run folder, each step once
    assert steps == [1, 2, 3, 4]
    for rank in (0, 1):
        assert sample_log(killed, rank) == sample_log(straight, rank)
        assert sorted({r["step"] for r in sample_log(killed, rank)}) == [1, 2, 3, 4]
