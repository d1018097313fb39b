"""One run per dump folder (sb_titan/util/run_lock.py): a second run is refused before
any rank spawns, naming the holder; a lock whose process is gone is taken over; the
processes and restarts of one run share its lock."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO, TINY, cpu_env, torchrun

from sb_titan.util.run_lock import (
    DumpFolderLocked,
    acquire,
    lock_path,
    read_holder,
    release,
    wait_for_run,
)

HOST = socket.gethostname()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _held_by_test(dump):
    holder = acquire(dump, os.getpid(), "the-test-run", "test")
    assert holder is not None and read_holder(lock_path(dump)) == holder
    return holder


def _refusal_line(dump, holder) -> str:
    return (
        f"sb_titan: refused: dump folder {dump} is in use by another run (host {HOST}, "
        f"pid {os.getpid()}, started {holder.started}; lock {lock_path(dump)}): use "
        "another dump_folder or stop that run"
    )


def test_a_run_on_a_held_folder_is_refused_before_spawning(tmp_path):
    """run_train.sh's pre-spawn step refuses in one line naming the holder, and neither
    spawns a rank nor touches the folder (the holder's failure record stays)."""
    holder = _held_by_test(tmp_path)
    (tmp_path / "last_failure.json").write_text("{}\n")
    proc = subprocess.run(
        ["./run_train.sh", "--dump_folder", str(tmp_path), *TINY, "--training.steps", "1"],
        cwd=REPO,
        env=cpu_env(NGPU="1", MAX_RESTARTS="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == _refusal_line(tmp_path, holder)
    assert "[rank" not in proc.stdout + proc.stderr  # torchrun never ran
    assert read_holder(lock_path(tmp_path)) == holder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_failure.json", "sb_titan.lock"]


@pytest.mark.torchrun
def test_torchrun_ranks_on_a_held_folder_are_refused(tmp_path):
    """Without run_train.sh (torchrun's agent and the trainer, as TorchTitan's own
    launcher runs it): rank 0 refuses before building anything, the other rank waits for
    the lock and is stopped by torchrun; nothing is written to the folder."""
    holder = _held_by_test(tmp_path)
    proc = torchrun(2, ["--training.steps", "1"], tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("sb_titan: refused:") == 1 and _refusal_line(tmp_path, holder) in out, out
    assert "Training starts" not in out
    assert [p.name for p in tmp_path.iterdir()] == ["sb_titan.lock"]
    assert read_holder(lock_path(tmp_path)) == holder


def test_stale_lock_is_taken_over_with_one_line(tmp_path, capsys):
    dead = _dead_pid()
    stale = acquire(tmp_path, dead, "a-dead-run", "test")
    new = acquire(tmp_path, os.getpid(), "new-run", "test")
    assert new is not None and read_holder(lock_path(tmp_path)) == new
    assert capsys.readouterr().err == (
        f"sb_titan: taking over the lock on {tmp_path}: its holder (host {HOST}, pid {dead}, "
        f"started {stale.started}) is no longer running\n"
    )
    # a live pid that is another process than the holder (pid reused): stale too
    body = json.loads(lock_path(tmp_path).read_text())
    lock_path(tmp_path).write_text(json.dumps({**body, "run": "old", "pid_start": "1"}))
    assert acquire(tmp_path, os.getpid(), "newer-run", "test") is not None
    assert "is no longer running" in capsys.readouterr().err


def test_one_runs_processes_and_restarts_share_the_lock(tmp_path):
    holder = acquire(tmp_path, os.getpid(), "run-a", "test")
    # the same process again (torchrun's agent on an elastic restart): its own lock
    assert acquire(tmp_path, os.getpid(), "run-a", "test") == holder
    # another process of the same run (another node's launcher): accepted, not owned
    assert acquire(tmp_path, holder.pid + 1, "run-a", "test") is None
    assert not release(tmp_path, holder.pid + 1, "run-a")
    # another run, its holder alive: refused in one line naming it
    with pytest.raises(DumpFolderLocked) as e:
        acquire(tmp_path, _dead_pid(), "run-b", "test")
    msg = str(e.value)
    assert "\n" not in msg and f"(host {HOST}, pid {os.getpid()}, started {holder.started}" in msg
    # a rank other than 0 waits until the lock names its run
    assert release(tmp_path, holder.pid, "run-a") and not lock_path(tmp_path).exists()
    later = threading.Timer(0.5, lambda: acquire(tmp_path, os.getpid(), "run-c", "test"))
    later.start()
    wait_for_run(tmp_path, "run-c", timeout=60)
    later.join()
    with pytest.raises(DumpFolderLocked, match="in use by another run"):
        wait_for_run(tmp_path, "run-d", timeout=0.5)
    lock_path(tmp_path).write_text("{")
    with pytest.raises(DumpFolderLocked, match="unreadable lock"):
        acquire(tmp_path, os.getpid(), "run-e", "test")


@pytest.mark.torchrun
def test_a_stopped_launch_stops_its_ranks_and_gives_the_folder_back(tmp_path):
    """SIGTERM to run_train.sh (its launcher: the script execs it) while ranks train:
    torchrun's agent stops them, the launcher releases the lock, says so in one line and
    exits 128 + 15; no process of the run is left."""
    args = ["./run_train.sh", "--dump_folder", str(tmp_path), *TINY, "--training.steps", "200"]
    proc = subprocess.Popen(
        args, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:  # until a step has trained
        seen.append(line)
        if "step:  1 " in line:
            break
    assert lock_path(tmp_path).exists(), "".join(seen[-20:])
    token = read_holder(lock_path(tmp_path)).run
    proc.terminate()
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=60) == 128 + 15, out[-3000:]
    assert out.strip().splitlines()[-1] == "sb_titan: stopped by SIGTERM", out[-3000:]
    assert not lock_path(tmp_path).exists()
    assert not _processes_of_run(token)  # the launcher stopped its forkserver before exiting


def _processes_of_run(token: str) -> list[str]:
    """Pids of live processes that inherited the run's token (every process of a run)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if f"SB_RUN_TOKEN={token}".encode() in environ.read_bytes().split(b"\0"):
                found.append(environ.parent.name)
    return found
