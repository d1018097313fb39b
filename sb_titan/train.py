"""Entry point: `python -m sb_titan.train --config_file X.toml [--section.key value ...]`.

run_train.sh launches this under torchrun. Config problems exit with status 2 and one
message naming the file and key (no traceback); everything else is TorchTitan's.
`--check-config` only validates; `--prelaunch` (run_train.sh, before torchrun) also
warns about restarts without checkpoints and prints the path where a rank records an
error that restarts would only repeat (sb_titan.elastic).
"""

from __future__ import annotations

import os
import sys

import sb_titan  # noqa: F401  (compat shims before torchtitan's trainer is imported)
from sb_titan.config.toml import ConfigError, load_config

CONFIG_FLAGS = ("--config_file", "--job.config_file")


def split_config_file(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config_file PATH` (or `=PATH`) out of the argument list."""
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
                raise ConfigError(f"{flag} needs a path")
        else:
            rest.append(arg)
        i += 1
    return path, rest


def parse(argv: list[str]):
    path, overrides = split_config_file(argv)
    return load_config(path, overrides)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    prelaunch = "--prelaunch" in argv
    check_only = prelaunch or "--check-config" in argv
    argv = [a for a in argv if a not in ("--check-config", "--prelaunch")]
    try:
        config = parse(argv)
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"sb_titan: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from sb_titan import elastic

    if prelaunch:
        print(elastic.prelaunch(config, int(os.environ.get("MAX_RESTARTS", "0"))))
    if check_only:
        return
    elastic.stop_if_earlier_fatal(config.dump_folder)
    run(config)


def run(config) -> None:
    import torch
    from torchtitan.tools.logging import init_logger, logger

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
        from sb_titan import elastic

        if elastic.is_permanent(e):  # a restart would repeat it: tell the next attempt
            elastic.record_fatal(config.dump_folder, e)
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
