"""Parallelization: TorchTitan's Qwen3 recipe and LLM pipeline split, unchanged but for
gloo's reduction (the runtime adds its micro-batch-aware schedules on top)."""

from __future__ import annotations

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

from sb_titan.compat import force_sum_reduction_on_gloo

pipeline_qwen2_5 = pipeline_llm


def parallelize_qwen2_5(model, **kwargs):
    """FSDP / TP / AC / compile exactly as Qwen3, then the gloo reduction fix."""
    model = parallelize_qwen3(model, **kwargs)
    force_sum_reduction_on_gloo(model)
    return model
