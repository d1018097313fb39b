"""torch.distributed gaps: `set_timeout` (newer than torch 2.13) and gloo's missing
PREMUL_SUM, which FSDP uses for a gradient divide factor of 1.0."""

from __future__ import annotations

import torch
import torch.distributed as dist


def backport_set_timeout() -> None:
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
