"""Elastic recovery: what a torchrun restart (`run_train.sh`, MAX_RESTARTS) needs.

torchrun restarts the whole worker group when a rank dies; the checkpointer then
resumes from the newest complete `step-N` (runtime/checkpoint.py). This module makes
the rest of a restart clean:

  * errors that would only recur (config, data, profile) are recorded in
    `dump_folder/fatal_error.json`; the ranks of the next attempt find the record and
    stop at once instead of failing again, and run_train.sh reports the cause once;
  * TensorBoard scalars of a restarted (or resumed) run go to the same run folder,
    with `purge_step` = the first step this process trains, so replayed steps show once
    (runtime/tensorboard.py);
  * sample / attention logs are cut back to the steps before that first step;
  * a test-only switch kills one rank at a fixed step (SB_FAULT_KILL_AT_STEP,
    SB_FAULT_KILL_RANK), on the first attempt only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

from sb_titan.util.files import write_atomic


class NotRetryable(Exception):
    """Mixed into errors a restart would only repeat (config.toml's ConfigError)."""


FATAL_FILE = "fatal_error.json"
FAILURE_FILE = "last_failure.json"
"""The latest error any rank of this job died of (retried or not): the launcher ends
with it as one line when the job fails."""
NOT_RETRIED_EXIT = 3
"""Exit status of a job stopped by an error that a restart would only repeat."""
LAUNCHER_ENV = "SB_LAUNCHER"
"""The launcher (sb_titan.tools.launch, run_train.sh's) sets it to 'run_train.sh': it
reports the recorded cause after torchrun returns, so the stopped attempt's ranks may
exit 0 (ending the restarts at once)."""


def restart_count() -> int:
    """Which attempt this is (0 = first); torchrun sets it in every worker."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


# -- before spawning --------------------------------------------------------------------------
def restart_warning(config, max_restarts: int) -> str | None:
    """Restarts without checkpoints replay the run from step 0 (or from
    checkpoint.initial_load_path): allowed, but worth saying before the job starts."""
    if max_restarts > 0 and not config.checkpoint.enable:
        return (
            f"MAX_RESTARTS={max_restarts} but checkpoint.enable is false: a restarted job "
            "starts again from step 0; set --checkpoint.enable (and checkpoint.interval) "
            "or MAX_RESTARTS=0"
        )
    return None


def fatal_path(dump_folder: str | os.PathLike) -> Path:
    return Path(dump_folder) / FATAL_FILE


def prelaunch(config, max_restarts: int) -> None:
    """The launcher's step before any rank spawns: warn about restarts without
    checkpoints and clear the error records of an earlier job."""
    warning = restart_warning(config, max_restarts)
    if warning:
        print(f"sb_titan: warning: {warning}", file=sys.stderr)
    Path(config.dump_folder, FAILURE_FILE).unlink(missing_ok=True)
    fatal_path(config.dump_folder).unlink(missing_ok=True)


def job_outcome(dump_folder: str | os.PathLike, failed_exitcode: int | None) -> tuple[int, str]:
    """How the launcher ends once torchrun returns (`failed_exitcode`: the first failed
    rank's, None if every rank exited 0): exit status and last line. An error restarts
    would only repeat ends with NOT_RETRIED_EXIT (its stopped attempt exited 0); any
    other failure with 1, as torchrun, and its recorded cause once (the tracebacks are
    above it)."""
    fatal = _recorded(fatal_path(dump_folder))
    if fatal is not None:
        return NOT_RETRIED_EXIT, f"sb_titan: not retried: {fatal}"
    if failed_exitcode is None:
        return 0, ""
    cause = _recorded(Path(dump_folder, FAILURE_FILE))
    if cause is None:
        cause = f"a rank exited with status {failed_exitcode} without a Python error (killed?)"
    return 1, f"sb_titan: failed: {cause}"


def _recorded(path: Path) -> str | None:
    record = _read_record(path)
    if record is None:
        return None
    return f"{record['cause']} (rank {record['rank']}, attempt {record['attempt']})"


def _read_record(path: Path) -> dict | None:
    """An error record (`_record`), or None where there is none or it is torn."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


# -- errors that must not be retried ----------------------------------------------------------
def is_permanent(error: BaseException) -> bool:
    """Errors a user has to fix (config, dataset, vocabulary, latency profile, a corrupt
    checkpoint without fallback): a restart repeats them."""
    # imported here: the launcher reads this module's records without loading the trainer
    from sb_titan.balance.cost_model import ProfileError
    from sb_titan.data.checksums import ChecksumError
    from sb_titan.data.indexed import DatasetError
    from sb_titan.data.source import VocabularyError
    from sb_titan.runtime.checkpoint import CheckpointIntegrityError

    permanent = (
        NotRetryable,
        DatasetError,
        ChecksumError,
        VocabularyError,
        ProfileError,
        CheckpointIntegrityError,
    )
    return isinstance(error, permanent)


def one_line(error: BaseException) -> str:
    """The cause in one line (errors re-raised from a loader thread carry the original
    traceback in their message; its last line is the original `module.Error: message`)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    qualified = r"^(?:[A-Za-z_]\w*\.)+(\w*(?:Error|Exception): )"  # module.path.SomeError:
    last = re.sub(qualified, r"\1", lines[-1]) if lines else ""
    if last.startswith(f"{type(error).__name__}: "):
        return last
    return f"{type(error).__name__}: {last}".rstrip(": ")


def record_failure(dump_folder: str | os.PathLike, error: BaseException) -> None:
    """Every rank that dies of an exception leaves its cause in one line; an error a
    restart would only repeat also goes where the next attempt's ranks (on any node:
    dump_folder is shared) and run_train.sh find it. Written atomically."""
    record = json.dumps(_record(error)) + "\n"
    write_atomic(Path(dump_folder, FAILURE_FILE), record)
    if is_permanent(error):
        write_atomic(fatal_path(dump_folder), record)


def _record(error: BaseException) -> dict:
    return {
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "attempt": restart_count(),
        "rank": _rank(),
        "cause": one_line(error),
    }


def earlier_fatal(dump_folder: str | os.PathLike) -> str | None:
    """The cause recorded by an earlier attempt of this same torchrun job, if any."""
    if restart_count() == 0:
        return None
    record = _read_record(fatal_path(dump_folder))
    if record is None:
        return None
    if record.get("run_id") != os.environ.get("TORCHELASTIC_RUN_ID"):
        return None  # another job's record (not launched through run_train.sh)
    return str(record.get("cause", "unknown error"))


def stop_if_earlier_fatal(dump_folder: str | os.PathLike) -> None:
    """On a restart after a permanent error: exit before building anything. Under
    run_train.sh exit 0, so torchrun stops restarting and the script reports the cause;
    under a bare torchrun exit NOT_RETRIED_EXIT (each remaining attempt ends at once)."""
    cause = earlier_fatal(dump_folder)
    if cause is None:
        return
    if _rank() == 0:
        print(f"sb_titan: not retrying: {cause}", file=sys.stderr)
    launched = os.environ.get(LAUNCHER_ENV) == "run_train.sh"
    raise SystemExit(0 if launched else NOT_RETRIED_EXIT)


# -- replayed steps logged once ---------------------------------------------------------------
def truncate_step_log(path: str | os.PathLike, first_step: int) -> None:
    """Keep only the records of steps before `first_step` (a torn last line from a
    killed process goes too), so a replayed step is logged once."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step", first_step) < first_step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept))


# -- fault injection (tests only) -------------------------------------------------------------
def maybe_inject_fault(step: int) -> None:
    """Test-only: SB_FAULT_KILL_AT_STEP=N SB_FAULT_KILL_RANK=R makes rank R SIGKILL itself
    at the start of step N of the first attempt, like a lost node would;
    SB_FAULT_RAISE_AT_STEP=N makes rank R raise a (retryable) RuntimeError at step N of
    every attempt, like a bug would."""
    rank = int(os.environ.get("SB_FAULT_KILL_RANK", "0"))
    if _rank() != rank:
        return
    if os.environ.get("SB_FAULT_RAISE_AT_STEP") == str(step):
        raise RuntimeError(f"injected fault at step {step}")
    at = os.environ.get("SB_FAULT_KILL_AT_STEP")
    if not at or restart_count() != 0 or step != int(at):
        return
    print(f"sb_titan: fault injection: killing rank {_rank()} at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
