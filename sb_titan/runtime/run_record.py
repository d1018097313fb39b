"""The run record: what a run was (its resolved config) and how it was laid out.

A checkpoint holds weights, not the config that gives them a shape, and DCP cannot
tell a resume that the ranks it finds are not the ranks that saved. So every run
writes `run_record.json` into its dump folder, and into every checkpoint step folder
before the integrity manifest is finalised (runtime/checkpoint.py), so the manifest
covers it:

  * `config`: the resolved config (defaults, TOML file and command-line overrides) as
    nested tables that `config.toml.config_from_table` reads back into the same config;
  * `layout`: world size, DP / PP / CP / TP degrees, micro-batches per DP rank and step,
    and the global batch; a resume on another layout is refused before ranks spawn.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sb_titan.balance.step_shape import step_shape
from sb_titan.util.files import write_atomic

RECORD = "run_record.json"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Layout:
    """How a run cuts its steps over its ranks; a resume must find the same."""

    world: int
    dp: int
    pp: int
    cp: int
    tp: int
    microbatches: int
    """Micro-batches per DP rank and step."""
    global_batch: int
    """Rows of training.seq_len tokens per step, over all DP ranks."""

    def describe(self) -> str:
        return (
            f"world {self.world} (DP {self.dp}, PP {self.pp}, CP {self.cp}, TP {self.tp}), "
            f"{self.microbatches} micro-batch(es) per DP rank, global batch {self.global_batch}"
        )


def layout_of(config: Any, world: int) -> Layout:
    """The layout `config` (an SBTrainer.Config) trains with on `world` ranks."""
    shape = step_shape(config, world)
    p = config.parallelism
    return Layout(
        world=world,
        dp=shape.dp,
        pp=p.pipeline_parallel_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        microbatches=shape.microbatches,
        global_batch=shape.dp * shape.microbatches * shape.rows,
    )


def config_table(config: Any) -> dict[str, Any]:
    """A config as the nested tables a TOML file would give (`model_spec` is derived, so
    left out). The two tables that choose a component are written the way config/toml.py
    reads them: `[activation_checkpoint] mode` and `[loss] num_chunks`."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed.activation_checkpoint import FullAC

    special = ("model_spec", "activation_checkpoint", "loss")
    table = _table(config, skip=special)
    ac, loss = config.activation_checkpoint, config.loss
    mode = "none" if ac is None else "full" if isinstance(ac, FullAC.Config) else "selective"
    table["activation_checkpoint"] = {"mode": mode}
    chunked = isinstance(loss, ChunkedLossWrapper.Config)
    table["loss"] = {"num_chunks": loss.num_chunks if chunked else 1}
    return table


def _table(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        f.name: _value(f.name, getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if f.name not in skip
    }


def _value(name: str, value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _table(value)
    if isinstance(value, (list, tuple)):
        return [_value(name, v) for v in value]
    if isinstance(value, dict):
        return {str(k): _value(name, v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"run record: cannot write '{name}' = {value!r} ({type(value).__name__})")


def make_record(config: Any, world: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "config": config_table(config),
        "layout": dataclasses.asdict(layout_of(config, world)),
    }


def write_record(folder: str | Path, record: dict[str, Any]) -> Path:
    return write_atomic(Path(folder) / RECORD, json.dumps(record, indent=1) + "\n")


def read_record(folder: str | Path) -> dict[str, Any] | None:
    """The record in `folder` (a step folder or a dump folder); None if it has none
    (written before runs kept one). ValueError, naming the file, if it is unreadable."""
    path = Path(folder) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
        Layout(**record["layout"])
        if not isinstance(record["config"], dict):
            raise ValueError("'config' is not a table")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable run record {path}: {e}") from None
    return record


def layout_mismatch(saved: dict[str, Any], current: Layout, where: str) -> str | None:
    """One line naming both layouts if the checkpoint was saved on another; else None."""
    before = Layout(**saved["layout"])
    if before == current:
        return None
    return f"{where} was saved on {before.describe()}; this run has {current.describe()}"
