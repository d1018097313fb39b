"""What a run prints: TorchTitan's step line with SparseBalance's signals (none of the
fields a CPU cannot measure), TorchTitan's harmless messages filtered at its logger, and
recurring warnings rate-limited. Log records are captured; nothing is timed."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torchtitan.components.metrics import LoggerContainer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import get_peak_flops

from sb_titan import compat
from sb_titan.data.tokenizer import TOKENIZER_DIR
from sb_titan.runtime.checkpoint import IntegrityCheckpointManager
from sb_titan.runtime.console import (
    NO_SAFETENSORS_INDEX,
    HarmlessMessages,
    SBMetricsProcessor,
    install_log_filter,
)
from sb_titan.runtime.tensorboard import RunTensorBoardLogger, read_scalars
from sb_titan.util.repeats import Repeats


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _captured(on_cpu: bool | None = True):
    """Records reaching TorchTitan's (the root) logger's handlers, with the recipe's
    filter installed (on_cpu None: without it)."""
    records, level, filters = _Records(), logger.level, list(logger.filters)
    for f in filters:  # one an in-process sb-train main() left (it is meant to stay)
        if isinstance(f, HarmlessMessages):
            logger.removeFilter(f)
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    if on_cpu is not None:
        install_log_filter(on_cpu)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        logger.filters[:] = filters


def test_torchtitan_emits_what_the_filter_drops():
    """Without the filter TorchTitan really says these (so the filter is not dead code)."""
    with _captured(on_cpu=None) as seen:
        IntegrityCheckpointManager.Config()
        get_peak_flops("cpu")
    assert "initial_load_model_only=True has no effect without an initial_load_path." in seen
    assert "Peak flops undefined for: cpu, fallback to A100" in seen


def test_harmless_messages_are_filtered_at_torchtitans_logger():
    with _captured(on_cpu=True) as seen:
        IntegrityCheckpointManager.Config()  # the config defaults; no initial load
        get_peak_flops("cpu")  # lspci and the A100 fallback: MFU is not shown on CPU
        logger.warning(
            "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"
        )
        logger.info("CPU memory usage for model: -0.00GiB(-0.00%)")
        logger.warning(f"{NO_SAFETENSORS_INDEX}{TOKENIZER_DIR}/model.safetensors.index.json. x")
    assert seen == []


def test_everything_else_still_shows():
    with _captured(on_cpu=False) as seen:
        get_peak_flops("cpu")  # on a GPU host an unknown device's MFU peak matters
        logger.warning("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 0 will be overridden to 3 x")
        logger.warning(f"{NO_SAFETENSORS_INDEX}/ckpt/Qwen2.5-3B/model.safetensors.index.json. x")
        logger.warning("Warmup (4) + decay (3) steps exceed total steps (4).")
        # The recipe's own modules log under their names: never filtered.
        logging.getLogger("sb_titan.x").warning("initial_load_model_only=True has no effect")
    assert "Peak flops undefined for: cpu, fallback to A100" in seen
    assert len([m for m in seen if "ENV[" in m or "safetensors" in m or "Warmup" in m]) == 3
    assert "initial_load_model_only=True has no effect" in seen


def test_repeats_are_shown_at_powers_of_two_with_their_count():
    repeats = Repeats()
    with _captured() as seen:
        shown = [repeats.warning(logger, "drift", f"error {n}%") for n in range(1, 11)]
        repeats.warning(logger, "other", "another kind")
    assert [n for n, s in enumerate(shown, 1) if s] == [1, 2, 4, 8]
    assert seen == [
        "error 1% [1 time so far; shown at 1, 2, 4, 8, ...]",
        "error 2% [2 times so far; shown at 1, 2, 4, 8, ...]",
        "error 4% [4 times so far; shown at 1, 2, 4, 8, ...]",
        "error 8% [8 times so far; shown at 1, 2, 4, 8, ...]",
        "another kind [1 time so far; shown at 1, 2, 4, 8, ...]",
    ]


RECIPE = {
    "balance/rank_imbalance": 1.25,
    "balance/bubble_share": 0.125,
    "dst/budget_mean": 0.75,
    "sparsity/density": 0.25,
    "balance/ideal_step_s": 0.5,
}


def _processor(tmp_path) -> SBMetricsProcessor:
    """The real processor, as the trainer builds it, writing real TensorBoard events."""
    compat.install()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    config = SBMetricsProcessor.Config(log_freq=1, disable_color_printing=True)
    processor = config.build(parallel_dims=dims, dump_folder=str(tmp_path))
    processor.logger = LoggerContainer()
    processor.logger.add_logger(RunTensorBoardLogger(tmp_path / "tb"))
    processor.num_flops_per_token = 6_000
    return processor


def _step(processor, step: int) -> None:
    processor.ntokens_since_last_log = 4096
    processor.data_loading_times.append(0.01)
    processor.log(step, 5.0, 5.5, 1.25, extra_metrics={"lr": 1e-3})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU step line")
def test_cpu_step_line_carries_the_recipe_signals_and_no_memory_or_mfu(tmp_path):
    processor = _processor(tmp_path)
    with _captured() as seen:
        _step(processor, 1)
        assert seen == []  # held until the trainer has measured the step
        processor.finish_step(1, RECIPE)
        processor.finish_step(2, {"dst/budget_mean": 0.5})  # a step TorchTitan did not log
        _step(processor, 3)
        processor.finish_step(3)  # no recipe metrics (e.g. no plan yet)
    processor.close()
    (line, plain) = seen
    assert line.startswith("step:  1  loss:  5.00000  grad_norm:  1.2500  tps: ")
    assert line.endswith("imbalance: 1.250  bubble: 12.5%  budget: 0.750  density: 0.250")
    assert plain.startswith("step:  3") and "imbalance" not in plain
    assert "memory" not in line + plain and "mfu" not in line + plain
    scalars = read_scalars(tmp_path)
    assert scalars["balance/rank_imbalance"] == {1: 1.25}
    assert scalars["dst/budget_mean"] == {1: 0.75, 2: 0.5}
    assert scalars["loss_metrics/global_avg_loss"] == {1: 5.0, 3: 5.0}
    assert not [t for t in scalars if t.startswith("memory/") or t.startswith("mfu")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory and MFU are CUDA fields")
def test_gpu_step_line_keeps_memory_and_mfu(tmp_path):
    processor = _processor(tmp_path)
    with _captured(on_cpu=False) as seen:
        _step(processor, 1)
        processor.finish_step(1, RECIPE)
    processor.close()
    (line,) = seen
    assert "memory: " in line and "mfu: " in line and "imbalance: 1.250" in line
    scalars = read_scalars(tmp_path)
    assert "memory/max_reserved(GiB)" in scalars and "mfu(%)" in scalars
