"""torch.distributed gaps: `set_timeout` (newer than torch 2.13) and gloo's missing
PREMUL_SUM, which FSDP uses for a gradient divide factor of 1.0; and the private
functional collectives context parallelism runs on."""

from __future__ import annotations

import torch
import torch.distributed as dist


def backport_set_timeout() -> None:
    """`dist.set_timeout` (TorchTitan calls it after the first step) on a torch without
    it, over the private `_set_pg_timeout` it wraps."""
    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed import distributed_c10d

    def set_timeout(timeout, group=None) -> None:
        distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


def force_sum_reduction_on_gloo(model: torch.nn.Module) -> None:
    """Gloo has no PREMUL_SUM, which FSDP uses for a gradient divide factor of 1.0;
    a plain SUM is the same math here (TorchTitan scales by global tokens itself)."""
    if not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def all_gather_single(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Functional all-gather along `dim` (torch's private functional collectives: the
    ones that trace, and run on gloo and NCCL alike)."""
    import torch.distributed._functional_collectives as funcol

    return _wait(funcol.all_gather_single(x, dim, group_name))


def reduce_scatter_single(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Functional sum-reduce-scatter along `dim` (see all_gather_single)."""
    import torch.distributed._functional_collectives as funcol

    return _wait(funcol.reduce_scatter_single(x, "sum", dim, group_name))


def group_size(group_name: str) -> int:
    """Size of the process group registered as `group_name` (the functional
    collectives address groups by name; torch's lookup by name is private)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_group_size_by_name(group_name)


def _wait(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
