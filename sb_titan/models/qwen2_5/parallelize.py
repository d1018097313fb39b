"""Parallelization: TorchTitan's Qwen3 recipe and LLM pipeline split, unchanged but for
gloo's reduction and context parallelism (the runtime adds its micro-batch-aware
schedules on top)."""

from __future__ import annotations

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

from sb_titan.compat import force_sum_reduction_on_gloo
from sb_titan.models.qwen2_5.attention import CPGroup, SBAttention

pipeline_qwen2_5 = pipeline_llm


class _CPDoneHere:
    """parallel_dims as Qwen3's recipe should see it: CP is the recipe's own (its inner
    attention gathers K/V itself), so TorchTitan's SDPA/Flex CP wrapping must not run;
    every mesh, FSDP's dp_shard x cp included, stays TorchTitan's."""

    cp_enabled = False

    def __init__(self, parallel_dims) -> None:
        self._dims = parallel_dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


def parallelize_qwen2_5(model, **kwargs):
    """FSDP / TP / AC / compile exactly as Qwen3, then the gloo reduction fix; under
    context parallelism every attention module learns its CP group."""
    dims = kwargs["parallel_dims"]
    if dims.cp_enabled:
        kwargs["parallel_dims"] = _CPDoneHere(dims)
        mesh = dims.get_mesh("cp")
        group = CPGroup(mesh.get_local_rank(), mesh.get_group().group_name)
        for module in model.modules():
            if isinstance(module, SBAttention):
                module.cp = group
    model = parallelize_qwen3(model, **kwargs)
    force_sum_reduction_on_gloo(model)
    return model
