"""The config a checkpoint was trained with, for the tools that read one (sb-export,
sb-eval, sb-plan): its run record's (runtime/run_record.py) by default, so a checkpoint
needs no TOML beside it. An explicit `--config` is still accepted, but only if it
agrees with the record on the keys the tool reads: exporting or planning with a config
the weights were not trained with would fail deep in the load, or answer for another run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sb_titan.config.toml import ConfigError, config_from_table, load_config
from sb_titan.runtime.run_record import RECORD, config_table, read_record

MODEL_KEYS = (
    "model",
    "sparse_attention",
    "hf_assets_path",
    "checkpoint.initial_load_path",
    "checkpoint.initial_load_in_hf",
    "dst.beta0",
)
"""What loading a checkpoint's model reads (eval/checkpoint.py): its sections and the
HF config.json an initial load took its dimensions from (the path counts only for an HF
initial load); dst.beta0 is sb-eval's budget."""
SHAPE_KEYS = (
    "training.seq_len",
    "training.local_batch_size",
    "training.global_batch_size",
    "parallelism.pipeline_parallel_degree",
    "parallelism.tensor_parallel_degree",
    "parallelism.context_parallel_degree",
    "parallelism.pipeline_parallel_microbatch_size",
    "sab",
    "dataloader.synthetic_docs",
    "dataloader.synthetic_seed",
)
"""What sb-plan reads: the step shape (balance/step_shape.py) and the packing policy."""


def checkpoint_config(
    step_dir: str | Path,
    config_path: str | Path | None = None,
    cli_args: list[str] | None = None,
    keys: tuple[str, ...] = MODEL_KEYS,
):
    """The config `step_dir` was trained with. Without `config_path`: its run record's.
    With one: that file's (+ `cli_args`), refused with one line naming the differing
    keys unless it agrees with the record on `keys`. A checkpoint saved before runs kept
    a record needs `config_path`. Raises ConfigError."""
    step_dir = Path(step_dir)
    try:
        record = read_record(step_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config_path is None:
        if record is None:
            raise ConfigError(
                f"checkpoint {step_dir} has no {RECORD} (saved before runs kept their "
                "config): pass --config, the TOML it was trained with"
            )
        return config_from_table(record["config"], str(step_dir / RECORD))
    config = load_config(config_path, cli_args)
    if record is not None:
        if not record["config"]["checkpoint"].get("initial_load_in_hf"):
            keys = tuple(k for k in keys if k != "checkpoint.initial_load_path")
        differ = differing_keys(record["config"], config_table(config), keys)
        if differ:
            raise ConfigError(
                f"--config {config_path} disagrees with the config checkpoint {step_dir} was "
                f"trained with ({RECORD}) on {', '.join(differ)}; leave out --config to use "
                "the checkpoint's own"
            )
    return config


def differing_keys(recorded: dict, given: dict, keys: tuple[str, ...]) -> list[str]:
    """Dotted keys under `keys` whose values differ, as `key = given (checkpoint: recorded)`."""
    a, b = _flatten(recorded), _flatten(json.loads(json.dumps(given)))
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == k or key.startswith(f"{k}.") for k in keys) and a.get(key) != b.get(key):
            out.append(f"{key} = {b.get(key)!r} (checkpoint: {a.get(key)!r})")
    return out


def _flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
