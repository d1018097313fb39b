"""`sb-launch [torchrun options] -- [sb-train arguments]`: what run_train.sh runs.

torchrun (`torch.distributed.run`: its parser, rendezvous, elastic agent and restarts)
around three things a bare torchrun does not do:

  * before any rank spawns, one process checks the run (sb_titan.tools.train.prelaunch:
    config, profile, dataset, checkpoint) and takes the dump folder's lock for this
    launcher; a problem is one line and exit status 2;
  * when the job ends, the lock is released and the output ends with the cause of a
    failure once (runtime/elastic.py), exit status 3 for an error restarts would only
    repeat;
  * where no GPU is present, the check and every rank of every attempt are forked from
    one server process that imported the trainer once (multiprocessing's forkserver,
    torchrun's `--run-path` entry point), instead of each importing it again: about
    13 CPU s per process on a 2-core machine, most of a small CPU run and of each
    elastic restart. With GPUs, the ranks start as torchrun starts them (fresh
    interpreters): a forked rank must not inherit an initialised CUDA driver, which
    has not been checked on a GPU. `SB_FORK_RANKS=0` starts fresh interpreters on CPU
    too. bench/launch.py measures both ways.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import time

from sb_titan.util import run_lock

USAGE = """usage: sb-launch [torchrun options] -- [sb-train arguments]

  e.g. sb-launch --standalone --nproc-per-node 2 --max-restarts 3 -- --config X.toml
  run_train.sh builds the torchrun options from its environment (./run_train.sh --help).
"""
FORK_ENV = "SB_FORK_RANKS"
#: what the forkserver imports once, before any check or rank is forked from it
FORK_PRELOAD = ["sb_titan.tools.train", "sb_titan.config.defaults"]
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if "--" not in argv:
        raise SystemExit(f"sb-launch: expected `--` before the sb-train arguments\n{USAGE}")
    split = argv.index("--")
    torchrun_argv, train_argv = argv[:split], argv[split + 1 :]
    for sig in _EXIT_SIGNALS:  # until torchrun's agent takes over: exit, releasing the lock
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))

    from torch.distributed.run import parse_args

    args = parse_args([*torchrun_argv, "-m", "sb_titan.tools.train", *train_argv])
    fork = forks_ranks()
    token = _set_run_environment(args)
    try:
        dump_folder = _check(train_argv, args, fork)
        try:
            code, last_line = _launch(args, fork, dump_folder)
        finally:
            run_lock.release(dump_folder, os.getpid(), token)
    finally:
        if fork:
            from sb_titan.compat.forkserver import stop_forkserver

            stop_forkserver()
    if last_line:
        print(last_line, file=sys.stderr)
    raise SystemExit(code)


def forks_ranks() -> bool:
    """Fork the check and the ranks from a preloaded server: by default only where no
    CUDA device is present (SB_FORK_RANKS=0/1 decides otherwise)."""
    setting = os.environ.get(FORK_ENV)
    if setting is not None:
        return setting != "0"
    import torch

    return not torch.cuda.is_available()


def _set_run_environment(args) -> str:
    """What every process of the run inherits: the run token the dump folder's lock
    names (run_lock.py; one per launch on one node, the rendezvous on several, so
    every node's launcher shares it), this launcher's pid, and torchrun's settings.
    Returns the token."""
    if args.standalone or not args.rdzv_endpoint:
        token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}:{random.random()}"
    else:
        token = f"rdzv:{args.rdzv_id}@{args.rdzv_endpoint}"
    os.environ.setdefault(run_lock.TOKEN_ENV, token)
    os.environ[run_lock.LAUNCHER_PID_ENV] = str(os.getpid())
    from sb_titan.runtime.elastic import LAUNCHER_ENV

    os.environ[LAUNCHER_ENV] = "run_train.sh"
    # Workers get a fresh TCPStore per attempt: the agent's shared one keeps the previous
    # attempt's keys, and a restarted rank can read a dead peer's address from it (gloo
    # "connectFullMesh ... Connection refused", or a hang; pytorch/pytorch#135712, #167288).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:  # what torchrun sets, before the server starts
        os.environ["OMP_NUM_THREADS"] = "1"
    return os.environ[run_lock.TOKEN_ENV]


def _check(train_argv: list[str], args, fork: bool) -> str:
    """Run sb_titan.tools.train.prelaunch in a child (forked from the preloaded server,
    or a fresh interpreter); exit with its status if it refused. Returns the dump folder."""
    import multiprocessing

    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    if fork:
        multiprocessing.set_forkserver_preload(FORK_PRELOAD)
    context = multiprocessing.get_context("forkserver" if fork else "spawn")
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    # the step shape is checked for a fixed world size (not for --nnodes=min:max)
    world = min_nodes * determine_local_world_size(args.nproc_per_node)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_prelaunch_child,
        args=(train_argv, world if min_nodes == max_nodes else None, args.max_restarts, send),
        name="sb_titan-check",
    )
    child.start()
    send.close()
    child.join()
    if child.exitcode != 0 or not receive.poll():
        raise SystemExit(child.exitcode or 1)
    return receive.recv()


def _prelaunch_child(train_argv: list[str], world: int | None, max_restarts: int, send) -> None:
    from sb_titan.tools.train import prelaunch

    if world is not None:
        os.environ["WORLD_SIZE"] = str(world)
    send.send(str(prelaunch(train_argv, max_restarts)))


def _launch(args, fork: bool, dump_folder: str) -> tuple[int, str]:
    """torchrun's own `run`; forked ranks run train.py through `--run-path` (runpy in
    the forked process, so its imports are the server's). Returns exit status and
    last line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from sb_titan.runtime import elastic

    if fork:
        import sb_titan.tools.train as train

        args.run_path, args.module, args.training_script = True, False, train.__file__
        args.start_method = "forkserver"
    try:
        run(args)
    except ChildFailedError as failed:
        print(failed, file=sys.stderr)  # every failed rank, as torchrun prints it
        return elastic.job_outcome(dump_folder, failed.get_first_failure()[1].exitcode)
    except SignalException as stopped:
        return 128 + int(stopped.sigval), f"sb_titan: stopped by {stopped.sigval.name}"
    return elastic.job_outcome(dump_folder, None)


if __name__ == "__main__":
    main()
