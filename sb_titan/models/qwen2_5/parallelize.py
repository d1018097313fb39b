"""Parallelization: TorchTitan's Qwen3 recipe plus the recipe's pipeline schedules."""

from __future__ import annotations

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

from sb_titan.compat import force_sum_reduction_on_gloo
from sb_titan.schedule import rebuild_schedule


def parallelize_qwen2_5(model, **kwargs):
    """FSDP / TP / AC / compile exactly as Qwen3, then the gloo reduction fix."""
    model = parallelize_qwen3(model, **kwargs)
    force_sum_reduction_on_gloo(model)
    return model


def pipeline_qwen2_5(model, **kwargs):
    """TorchTitan's LLM pipeline split, with the schedule swapped for the recipe's
    micro-batch-aware subclass (same stages, micro-batches, loss and scaling)."""
    schedule, model_parts, has_first, has_last = pipeline_llm(model, **kwargs)
    name = kwargs["parallelism"].pipeline_parallel_schedule
    schedule = rebuild_schedule(schedule, name)
    return schedule, model_parts, has_first, has_last
