"""Read back the scalars a run wrote to TensorBoard (benchmarks and tests use it)."""

from __future__ import annotations

import glob
from pathlib import Path


def read_scalars(dump_folder: str | Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file under dump_folder/tb. Within a run
    folder TensorBoard's own purge rules apply (a restarted job writes with purge_step,
    see sb_titan.elastic); across folders later runs overwrite earlier values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for run in sorted(glob.glob(str(Path(dump_folder) / "tb" / "*"))):
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out
