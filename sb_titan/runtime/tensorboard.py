"""TensorBoard: the run's writer, restart-aware (one run folder across restarts, replayed
steps purged), with a Custom Scalars layout that puts SparseBalance's story on one page,
and readers of the scalars and layout a run wrote (benchmarks and tests use them)."""

from __future__ import annotations

import glob
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from torchtitan.components.metrics import BaseLogger

from sb_titan.compat.metrics import metrics_rank
from sb_titan.runtime.elastic import restart_count


def read_scalars(dump_folder: str | Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file under dump_folder/tb. Within a run
    folder TensorBoard's own purge rules apply (a restarted job writes with purge_step,
    see RunTensorBoardLogger); across folders later runs overwrite earlier values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for run in sorted(glob.glob(str(Path(dump_folder) / "tb" / "*"))):
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


# The Custom Scalars tab: {category: {chart title: [scalar tags]}}, tags as the trainer
# logs them (docs/training.md lists each). Without PP, DST balances DP ranks, so its
# predicted imbalance compares with the measured rank imbalance; under PP it balances
# micro-batches, so with the micro-batch imbalance.
LAYOUT: dict[str, dict[str, list[str]]] = {
    "SparseBalance: balance": {
        "imbalance (max/mean): DST's prediction before/after vs measured": [
            "dst/predicted_imbalance_before",
            "dst/predicted_imbalance_after",
            "balance/rank_imbalance",
            "balance/microbatch_imbalance",
        ],
        "bubble share (step time outside block compute)": ["balance/bubble_share"],
        "step time (s): ideal (balanced) vs actual": [
            "balance/ideal_step_s",
            "balance/step_s",
        ],
    },
    "SparseBalance: budgets": {
        "DST budget over (rank, micro-batch): min / mean / max": [
            "dst/budget_min",
            "dst/budget_mean",
            "dst/budget_max",
        ],
    },
    "SparseBalance: sparsity": {
        "realised density and recall": ["sparsity/density", "sparsity/recall"],
        "recall: estimated vs true (sampled queries), and top-key hits": [
            "sparsity/recall",
            "sparsity/true_recall",
            "sparsity/top_key_hit",
        ],
        "recall: measured vs DST's prediction (chosen budgets, beta0 everywhere)": [
            "sparsity/recall",
            "dst/predicted_recall",
            "dst/predicted_recall_static",
        ],
    },
    "SparseBalance: cost model": {
        "prediction error (mean APE, before the step's refit)": ["cost_model/ape_mean"],
    },
}
CUSTOM_SCALARS_TAG = "custom_scalars__config__"  # where TensorBoard keeps a layout


def custom_scalars_layout(prefix: str | None = None) -> dict[str, dict[str, list]]:
    """LAYOUT as SummaryWriter.add_custom_scalars takes it: multiline charts whose tags
    are regular expressions, anchored and escaped (`(s)` in TorchTitan's tags)."""

    def pattern(tag: str) -> str:
        return "^" + re.escape(tag if prefix is None else f"{prefix}/{tag}") + "$"

    return {
        category: {title: ["Multiline", list(map(pattern, tags))] for title, tags in charts.items()}
        for category, charts in LAYOUT.items()
    }


def read_layout(dump_folder: str | Path) -> dict[str, dict[str, list[str]]]:
    """category -> chart title -> tag patterns, from the layout events under
    dump_folder/tb (the same merge as TensorBoard's: categories by title)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    out: dict[str, dict[str, list[str]]] = {}
    for run in sorted(glob.glob(str(Path(dump_folder) / "tb" / "*"))):
        acc = EventAccumulator(run, size_guidance={"tensors": 0})
        acc.Reload()
        if CUSTOM_SCALARS_TAG not in acc.Tags()["tensors"]:
            continue
        for event in acc.Tensors(CUSTOM_SCALARS_TAG):
            layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
            for category in layout.category:
                charts = out.setdefault(category.title, {})
                for chart in category.chart:
                    charts[chart.title] = list(chart.multiline.tag)
    return out


class RunTensorBoardLogger(BaseLogger):
    """TorchTitan's TensorBoardLogger, but the writer opens at the first step this process
    trains: a first run gets a new `tb/<timestamp>` folder; a resumed or restarted one
    appends to the newest folder with `purge_step` = that step, so TensorBoard hides the
    earlier attempt's events from that step on. Flushed every log call, so a killed job
    keeps its scalars up to the failure. Every writer also writes the Custom Scalars
    layout (LAYOUT); TensorBoard merges a folder's copies."""

    def __init__(self, tb_root: str | os.PathLike, sub: str | None = None, tag=None) -> None:
        self.tb_root, self.sub, self.tag = Path(tb_root), sub, tag
        self.writer: SummaryWriter | None = None

    def start(self, first_step: int) -> None:
        if self.writer is not None:
            return
        runs = sorted((p for p in self.tb_root.glob("*") if p.is_dir()), key=_mtime)
        if runs and (first_step > 1 or restart_count() > 0):
            run = runs[-1]
        else:
            run = self.tb_root / datetime.now().strftime("%Y%m%d-%H%M")
        log_dir = run / self.sub if self.sub else run
        self.writer = SummaryWriter(str(log_dir), max_queue=1000, purge_step=first_step)
        self.writer.add_custom_scalars(custom_scalars_layout(self.tag))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.start(step)
        for k, v in metrics.items():
            self.writer.add_scalar(k if self.tag is None else f"{self.tag}/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def add_run_tensorboard(metrics, config, parallel_dims) -> RunTensorBoardLogger | None:
    """TorchTitan's TensorBoard logger (same ranks, same tb/<run>[/rank_<r>] layout),
    but restart-aware: see elastic.RunTensorBoardLogger. Returns it, or None on a rank
    that does not write."""
    from torchtitan.components.metrics import LoggerContainer

    cfg = config.metrics
    rank = dist.get_rank()
    if not cfg.save_for_all_ranks:
        schedule = config.parallelism.pipeline_parallel_schedule
        if rank != metrics_rank(parallel_dims, schedule):
            return None
    if not isinstance(metrics.logger, LoggerContainer):
        metrics.logger = LoggerContainer()
    sub = f"rank_{rank}" if cfg.save_for_all_ranks else None
    tb_root = os.path.join(config.dump_folder, cfg.save_tb_folder)
    tensorboard = RunTensorBoardLogger(tb_root, sub)
    metrics.logger.add_logger(tensorboard)
    return tensorboard
