"""Entry point: `python -m sb_titan.tools.train --config X.toml [--section.key value ...]`.

run_train.sh launches this under torchrun (sb_titan.tools.launch). Problems found before
training (config, profile, dataset, checkpoint integrity) exit with status 2 and one line
naming the file and key or step, no traceback. `--check-config` checks and exits;
`prelaunch` (the launcher, before any rank spawns) also takes the dump folder's lock and
warns about restarts without checkpoints (runtime/elastic.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from sb_titan.util import run_lock

#: `--config` as in the other tools; TorchTitan's own spellings stay accepted
CONFIG_FLAGS = ("--config", "--config_file", "--job.config_file")
HELP_FLAGS = ("-h", "--help")
HELP_ALL = "--help-all"
# Printed without importing torch or TorchTitan: `--help` answers at once.
USAGE = """usage: sb-train --config X.toml [--check-config] [--section.key VALUE ...]

  --config X.toml       a train config (train_configs/); CLI overrides win over it
                        (--config_file, TorchTitan's name, is the same)
  --check-config        check the config and what it names (profile, dataset, tokenizer,
                        checkpoint) and exit; run_train.sh does this before spawning ranks
  --help-all            this, then every override with its type and default
                        (TorchTitan's whole option tree: slower, it loads the trainer)

Overrides use TorchTitan's names, e.g. --training.steps 4 --dump_folder DIR
--sab.policy sab; a boolean is --section.flag or --section.no-flag.
"""


def split_config_file(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config PATH` (or `--config_file`, or `=PATH`) out of the argument list."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_FLAGS:
            if eq:
                path = value
            elif i + 1 < len(argv):
                path, i = argv[i + 1], i + 1
            else:
                from sb_titan.config.toml import ConfigError

                raise ConfigError(f"{flag} needs a path")
        else:
            rest.append(arg)
        i += 1
    return path, rest


def parse(argv: list[str], check: bool = False, lock: bool = False):
    """The run's config; with `check`, also everything the launch can verify before
    spawning ranks (sb_titan.config.preflight); with `lock`, run_train.sh's dump-folder
    lock is taken first (before the checks read the checkpoint folder), and given back
    if a check fails."""
    import torch

    from sb_titan.config.toml import check_training_backend, load_config

    path, overrides = split_config_file(argv)
    config = load_config(path, overrides)
    check_training_backend(config, path, "cuda" if torch.cuda.is_available() else "cpu")
    holder = run_lock.claim_for_launcher(config.dump_folder) if lock else None
    if check:
        from sb_titan.config.preflight import preflight

        try:
            preflight(config, path)  # then the checkpoint folder: one line, no traceback
        except Exception:
            if holder is not None:
                run_lock.release(config.dump_folder, holder.pid, holder.run)
            raise
    return config


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if HELP_ALL in argv:
        print(USAGE)  # tyro then prints every override and exits 0
        argv = ["--help" if a == HELP_ALL else a for a in argv]
    elif any(a in HELP_FLAGS for a in argv):
        print(USAGE)
        return
    check_only = "--check-config" in argv
    argv = [a for a in argv if a != "--check-config"]
    _set_up_process()
    from sb_titan.runtime import elastic

    with _one_line_errors():
        config = parse(argv, check=check_only)
        if check_only:
            return
        # before this process writes anything there; ranks of this run share the lock
        holder = run_lock.claim_for_rank(config.dump_folder)
        elastic.stop_if_earlier_fatal(config.dump_folder)
        run(config, holder)


def prelaunch(argv: list[str], max_restarts: int) -> Path:
    """The launcher's step before any rank spawns: take the dump folder's lock for the
    launcher, run every check, warn about restarts without checkpoints. Returns the dump
    folder; a problem is one line and exit status 2, as in `main`."""
    _set_up_process()
    from sb_titan.runtime import elastic

    with _one_line_errors():
        config = parse(argv, check=True, lock=True)
        elastic.prelaunch(config, max_restarts)
        return Path(config.dump_folder)


def _set_up_process() -> None:
    """Past the help: what training (or checking a config) needs, imported only now."""
    from sb_titan import compat

    compat.install()  # entry point: TorchTitan's device handling on CPU, API backports
    import torch
    from torchtitan.tools.logging import init_logger

    from sb_titan.runtime.console import install_log_filter

    init_logger()  # before parsing: it logs what an HF initial load changes in [model]
    install_log_filter(on_cpu=not torch.cuda.is_available())  # its harmless messages


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """Problems a user must fix: one line, exit status 2, no traceback."""
    from sb_titan.config.toml import ConfigError
    from sb_titan.runtime.checkpoint import CheckpointIntegrityError

    try:
        yield
    except ConfigError as e:
        _stop("config error", e)
    except CheckpointIntegrityError as e:
        _stop("checkpoint error", e)
    except run_lock.DumpFolderLocked as e:
        _stop("refused", e, every_rank=True)  # recorded nowhere: the folder is not ours


def _stop(kind: str, error: Exception, every_rank: bool = False) -> None:
    """One line on rank 0 (every rank raises the same), exit status 2, no traceback."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        print(f"sb_titan: {kind}: {error}", file=sys.stderr)
    raise SystemExit(2) from None


def run(config, holder: run_lock.Holder | None = None) -> None:
    """Train (or write the seed checkpoint). `holder`: the dump-folder lock this process
    took, released when the run ends; after a failure only a lock of a process without
    launcher is (under torchrun the agent keeps it for the restart)."""
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from sb_titan.config.toml import ConfigError
    from sb_titan.runtime import elastic

    init_logger()
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            # One set of initial weights that runs of any parallel layout can start from.
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ConfigError("checkpoint.create_seed_checkpoint needs a single process")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception as e:
        elastic.record_failure(config.dump_folder, e)  # the job's last line, if it fails
        if trainer is not None:
            trainer.close()
        if holder is not None and holder.pid == os.getpid():
            run_lock.release(config.dump_folder, holder.pid, holder.run)
        raise
    trainer.close()
    if holder is not None:
        run_lock.release(config.dump_folder, holder.pid, holder.run)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
