"""One run per dump folder: an exclusive lock file, `dump_folder/sb_titan.lock`.

Two runs writing one dump folder destroy each other's checkpoints, TensorBoard events
and failure records. The lock names its holder as JSON: host, pid (with the process's
start time, so a reused pid is not mistaken for the holder), when it was taken, and a
run token shared by every process of one run:

  * run_train.sh's launcher (sb_titan/tools/launch.py) exports `SB_RUN_TOKEN` (random
    per launch on one node; on several nodes derived from the rendezvous id and
    endpoint, the same on every node) and `SB_LAUNCHER_PID` (its own pid); its check
    takes the lock before any rank spawns, and it removes it when torchrun returns;
  * under any torchrun (TorchTitan's own launcher included) without run_train.sh, the
    token is torchrun's run id (`TORCHELASTIC_RUN_ID`): global rank 0 takes the lock
    for its torchrun agent (its parent process, alive across elastic restarts), and
    removes it when the run ends;
  * every other rank takes nothing: it waits until the lock names its own run.

A lock whose token is the caller's own run (its launcher's, or an earlier attempt of
the same torchrun job) is accepted, so elastic restarts never refuse themselves. A lock
held by a process that no longer exists on this host is stale: it is taken over with a
one-line message. Anything else is refused with one line naming the holder. Only the
standard library is used: the launcher releases the lock without loading the trainer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

LOCK_FILE = "sb_titan.lock"
TOKEN_ENV = "SB_RUN_TOKEN"
LAUNCHER_PID_ENV = "SB_LAUNCHER_PID"
RANK_WAIT_S = 900.0
"""How long a rank other than 0 waits for its run's lock (a safety net: if rank 0 is
refused, torchrun stops the other ranks at once)."""


class DumpFolderLocked(RuntimeError):
    """Another run holds the dump folder; the message is one line naming the holder."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_start: str | None
    started: str
    run: str
    by: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def lock_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / LOCK_FILE


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, after the parenthesised name


def alive(pid: int, pid_start: str | None) -> bool:
    """Whether `pid` on this host is still the process that took the lock."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = process_start(pid)
    return pid_start is None or now is None or now == pid_start


def run_token() -> str:
    """This process's run: run_train.sh's token, else torchrun's run id, else its own."""
    return (
        os.environ.get(TOKEN_ENV)
        or os.environ.get("TORCHELASTIC_RUN_ID")
        or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    )


def _holder(pid: int, run: str, by: str) -> Holder:
    started = datetime.now().astimezone().isoformat(timespec="seconds")
    return Holder(socket.gethostname(), pid, process_start(pid), started, run, by)


def read_holder(path: Path) -> Holder | None:
    """The lock's holder; None if there is no lock. An unreadable lock is refused."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(text)
        return Holder(**{k: body[k] for k in Holder.__dataclass_fields__})
    except (ValueError, KeyError, TypeError) as e:
        raise DumpFolderLocked(
            f"{path}: unreadable lock ({e}); expected JSON with host, pid, started, run: "
            "delete it if no run uses this dump folder"
        ) from None


def _create(path: Path, holder: Holder) -> bool:
    """Create the lock with its whole content at once (temporary file, then a hard link,
    which fails if the lock exists); False if it exists."""
    tmp = path.with_name(f".{LOCK_FILE}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(holder)) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _guard(path: Path):
    """Serialises stale-lock takeovers on this host (only this host can judge them)."""
    with open(path.with_name(f".{LOCK_FILE}.guard"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _same_process(holder: Holder, pid: int) -> bool:
    return holder.host == socket.gethostname() and holder.pid == pid


def refusal(path: Path, holder: Holder) -> str:
    where = "" if holder.host == socket.gethostname() else " on another host"
    return (
        f"dump folder {path.parent} is in use by another run ({holder.describe()}; "
        f"lock {path}): use another dump_folder or stop that run"
        + (f"; delete {path.name} if that run{where} is gone" if where else "")
    )


def acquire(dump_folder: str | os.PathLike, pid: int, run: str, by: str) -> Holder | None:
    """Take the lock for `pid` / `run`, or accept it if `run` holds it already. Returns
    the holder if `pid` on this host holds it now (the caller then releases it), None if
    another process of the same run does; prints one line when a stale lock is taken
    over; raises DumpFolderLocked naming the holder otherwise."""
    path = lock_path(dump_folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = _holder(pid, run, by)
    for _ in range(10):
        if _create(path, mine):
            return mine
        holder = read_holder(path)
        if holder is None:
            continue  # released in between
        if holder.run == run:  # this run's launcher, or an earlier attempt of this job
            return holder if _same_process(holder, pid) else None
        if holder.host != socket.gethostname() or alive(holder.pid, holder.pid_start):
            raise DumpFolderLocked(refusal(path, holder))
        with _guard(path):
            if read_holder(path) == holder:  # nobody took it over meanwhile
                path.unlink()
                print(
                    f"sb_titan: taking over the lock on {path.parent}: its holder "
                    f"({holder.describe()}) is no longer running",
                    file=sys.stderr,
                    flush=True,
                )
    raise DumpFolderLocked(f"{path}: could not take the lock (it keeps changing hands)")


def wait_for_run(dump_folder: str | os.PathLike, run: str, timeout: float = RANK_WAIT_S) -> None:
    """A rank other than 0: return once the lock names `run` (rank 0 or the launcher
    took it); raise DumpFolderLocked naming the holder after `timeout` seconds."""
    path = lock_path(dump_folder)
    deadline = time.monotonic() + timeout
    holder = None
    while time.monotonic() < deadline:
        holder = read_holder(path)
        if holder is not None and holder.run == run:
            return
        time.sleep(0.2)
    if holder is None:
        raise DumpFolderLocked(f"{path}: rank 0 did not take the lock in {timeout:.0f} s")
    raise DumpFolderLocked(refusal(path, holder))


def release(dump_folder: str | os.PathLike, pid: int, run: str) -> bool:
    """Remove the lock if `pid` / `run` hold it; True if removed."""
    path = lock_path(dump_folder)
    try:
        holder = read_holder(path)
    except DumpFolderLocked:
        return False
    if holder is None or holder.run != run or not _same_process(holder, pid):
        return False
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a folder the lock alone made (a refused launch)
        path.parent.rmdir()  # only if empty: a run's outputs keep it
    return True


def claim_for_rank(dump_folder: str | os.PathLike) -> Holder | None:
    """What a training process does before it touches the dump folder (see the module
    docstring). Returns the holder this process created (it releases it at the end)."""
    run = run_token()
    if os.environ.get(TOKEN_ENV) is None and os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return acquire(dump_folder, os.getpid(), run, "python")  # no launcher: itself
    if int(os.environ.get("RANK", "0")) == 0:
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        pid = os.getppid() if under_torchrun else os.getpid()  # torchrun's agent
        return acquire(dump_folder, pid, run, "torchrun rank 0")
    wait_for_run(dump_folder, run)
    return None


def claim_for_launcher(dump_folder: str | os.PathLike) -> Holder | None:
    """The launcher's check: take the lock for the launcher's process before any rank
    spawns. Without the launcher's variables nothing is taken: the lock would outlive
    the check."""
    run, pid = os.environ.get(TOKEN_ENV), os.environ.get(LAUNCHER_PID_ENV)
    if not run or not pid:
        return None
    return acquire(dump_folder, int(pid), run, "run_train.sh")
