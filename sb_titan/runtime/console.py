"""What a run prints: TorchTitan's step line with SparseBalance's signals on it, without
the fields a CPU cannot measure, and without TorchTitan's messages that say nothing
about the run.

TorchTitan prints the step line inside its train_step, before the recipe has gathered
the step's measurements; SBMetricsProcessor holds the line (and its TensorBoard scalars)
until the trainer adds them (`finish_step`), so one line and one TensorBoard write
carry both.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from sb_titan.data.tokenizer import TOKENIZER_DIR

# (TensorBoard tag, label, format) of the recipe's fields on the step line.
STEP_LINE_FIELDS = (
    ("balance/rank_imbalance", "imbalance", "{:.3f}"),  # max/mean of DP ranks' compute
    ("balance/bubble_share", "bubble", "{:.1%}"),  # step time outside block compute
    ("dst/budget_mean", "budget", "{:.3f}"),  # mean DST budget over (rank, micro-batch)
    ("sparsity/density", "density", "{:.3f}"),  # realised share of block pairs computed
    ("sparsity/recall", "est. recall", "{:.3f}"),  # the estimator's own kept mass
    ("sparsity/true_recall", "true recall", "{:.3f}"),  # exact kept mass, sampled queries
    ("sparsity/top_key_hit", "top-key hit", "{:.3f}"),  # top true key in a kept block
)


class SBMetricsProcessor(MetricsProcessor):
    """TorchTitan's MetricsProcessor (same scalars, same line) with three changes: the
    line also shows rank imbalance, bubble share, mean budget, density and recall (estimated,
    true, top-key hits); on CPU the
    memory fields (CUDA allocator statistics: -1 bytes, -1 OOMs there) and MFU (against
    an A100's peak) are left out of the line and of TensorBoard; and a step's line waits
    for `finish_step`."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.on_cpu = self.device_memory_monitor.device.type == "cpu"
        self._pending: tuple[int, dict[str, Any], list[str]] | None = None

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        """TorchTitan's computation (components/metrics.py), held until finish_step."""
        self._flush()  # a step no one finished: as it stands
        time_delta = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        tflops = self.num_flops_per_token * tps / 1e12
        loading = self.data_loading_times
        metrics: dict[str, Any] = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "time_metrics/end_to_end(s)": time_delta / self.config.log_freq,
            "time_metrics/data_loading(s)": sum(loading) / len(loading),
            "time_metrics/data_loading(%)": 100 * sum(loading) / time_delta,
        }
        c = self.color
        line = [
            f"{c.red}step: {step:2}",
            f"{c.green}loss: {global_avg_loss:8.5f}",
            f"{c.orange}grad_norm: {grad_norm:7.4f}",
        ]
        if not self.on_cpu:
            mem = self.device_memory_monitor.get_peak_stats()
            metrics.update(_memory_metrics(mem))
            line.append(
                f"{c.turquoise}memory: {mem.max_reserved_gib:5.2f}GiB({mem.max_reserved_pct:.2f}%)"
            )
        line += [f"{c.blue}tps: {round(tps):,}", f"{c.cyan}tflops: {tflops:,.2f}"]
        if not self.on_cpu:
            mfu = None
            if not self.has_quantization:  # MFU against a BF16 peak misleads under FP8/MX
                mfu = metrics["mfu(%)"] = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
            line.append(f"{c.magenta}mfu: {'N/A' if mfu is None else f'{mfu:.2f}%'}")
        metrics.update(extra_metrics or {})
        self._pending = (step, metrics, line)
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    def finish_step(self, step: int, recipe_metrics: dict[str, Any] | None = None) -> None:
        """Log step `step`'s scalars and line with the recipe's metrics added (only the
        scalars when TorchTitan did not log this step)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] != step:
            self._emit(*pending)
            pending = None
        if pending is None:
            if recipe_metrics:
                self.logger.log(recipe_metrics, step)
            return
        _, metrics, line = pending
        metrics.update(recipe_metrics or {})
        self._emit(step, metrics, line + recipe_fields(recipe_metrics or {}, self.color))

    def _emit(self, step: int, metrics: dict[str, Any], line: list[str]) -> None:
        self.logger.log(metrics, step)
        logger.info("  ".join(line) + self.color.reset)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._emit(*pending)

    def close(self) -> None:
        self._flush()
        super().close()


def recipe_fields(metrics: dict[str, Any], color: Any) -> list[str]:
    """The step line's SparseBalance fields present in `metrics` (a dense run has no
    density, a run without DST budgets still has a budget: beta0)."""
    return [
        f"{color.yellow}{label}: {fmt.format(metrics[tag])}"
        for tag, label, fmt in STEP_LINE_FIELDS
        if tag in metrics
    ]


def _memory_metrics(mem) -> dict[str, float]:
    return {
        "memory/max_active(GiB)": mem.max_active_gib,
        "memory/max_active(%)": mem.max_active_pct,
        "memory/max_reserved(GiB)": mem.max_reserved_gib,
        "memory/max_reserved(%)": mem.max_reserved_pct,
        "memory/num_alloc_retries": mem.num_alloc_retries,
        "memory/num_ooms": mem.num_ooms,
    }


# TorchTitan's messages that tell nothing about the run, and why each is harmless.
HARMLESS = {
    "initial_load_model_only=True has no effect without an initial_load_path.": (
        "CheckpointManager.Config defaults the flag to True and warns on every validation "
        "of a config without an initial load (2-6 times per command: the TOML layer and "
        "tyro validate again); the flag only selects what an initial load reads"
    ),
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config": (
        "torchrun's agent sets 1 for every worker and TorchTitan always sets 3 (skip "
        "cleanup, which its flight recorder needs); a value a user set still shows"
    ),
}
HARMLESS_ON_CPU = {
    "Error running lspci:": "lspci is only searched for an H100, to pick the MFU peak",
    "Peak flops undefined for: cpu": "the MFU peak; MFU is not shown on CPU",
    "Peak FLOPS used for computing MFU:": "the same",
    "CPU memory usage for model:": "CUDA allocator statistics, absent on CPU (-0.00GiB)",
}
NO_SAFETENSORS_INDEX = "model.safetensors.index.json not found at hf_assets_path: "


class HarmlessMessages(logging.Filter):
    """Drops the records above from TorchTitan's logger (its records only: the recipe's
    modules log under their own names). Also the note that a checkpoint saved in HF
    format would be one file, when hf_assets_path is the shipped tokenizer folder,
    which never holds weights."""

    def __init__(self, on_cpu: bool) -> None:
        super().__init__()
        self.prefixes = tuple(HARMLESS) + (tuple(HARMLESS_ON_CPU) if on_cpu else ())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.prefixes):
            return False
        if message.startswith(NO_SAFETENSORS_INDEX):
            path = message[len(NO_SAFETENSORS_INDEX) :].split(". ", 1)[0]
            return Path(path).resolve().parent != TOKENIZER_DIR
        return True


def install_log_filter(on_cpu: bool) -> HarmlessMessages:
    """On TorchTitan's logger (the root logger; init_logger replaces its handlers, not
    its filters), once: a second call replaces the first filter."""
    for old in [f for f in logger.filters if isinstance(f, HarmlessMessages)]:
        logger.removeFilter(old)
    new = HarmlessMessages(on_cpu)
    logger.addFilter(new)
    return new
