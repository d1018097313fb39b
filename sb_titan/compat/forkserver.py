"""multiprocessing's forkserver has no public stop: a process that forked its workers
from one stops and reaps it when it is done, so that no server outlives it and the
server's and its forked children's CPU time counts as this process's children's (what
`time ./run_train.sh` and the test suite's CPU figures read)."""

from __future__ import annotations

import multiprocessing.forkserver


def stop_forkserver() -> None:
    """Stop this process's forkserver, if one was started, and wait for it."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        server._stop()
