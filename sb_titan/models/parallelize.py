"""Parallelization: each family's TorchTitan recipe and LLM pipeline split, unchanged but
for gloo's reduction and context parallelism (the runtime adds its micro-batch-aware
schedules on top)."""

from __future__ import annotations

from collections.abc import Callable

from sb_titan.compat import force_sum_reduction_on_gloo
from sb_titan.models.attention import CPGroup, SBAttention


class _CPDoneHere:
    """parallel_dims as TorchTitan's recipe should see it: CP is the recipe's own (its
    inner attention gathers K/V itself), so TorchTitan's SDPA/Flex CP wrapping must not
    run; every mesh, FSDP's dp_shard x cp included, stays TorchTitan's."""

    cp_enabled = False

    def __init__(self, parallel_dims) -> None:
        self._dims = parallel_dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


def parallelize_with_recipe_attention(parallelize: Callable, model, **kwargs):
    """A family's TorchTitan `parallelize` (FSDP / TP / AC / compile) as it is, then the
    gloo reduction fix; under context parallelism every attention module learns its CP
    group."""
    dims = kwargs["parallel_dims"]
    if dims.cp_enabled:
        kwargs["parallel_dims"] = _CPDoneHere(dims)
        mesh = dims.get_mesh("cp")
        group = CPGroup(mesh.get_local_rank(), mesh.get_group().group_name)
        for module in model.modules():
            if isinstance(module, SBAttention):
                module.cp = group
    model = parallelize(model, **kwargs)
    force_sum_reduction_on_gloo(model)
    return model


def pipeline_llm(model, **kwargs):
    """TorchTitan's LLM pipeline split, imported when called: TorchTitan's distributed
    modules must load after the entry point's compat.install()."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm as split

    return split(model, **kwargs)
