"""Feature-detected shims so TorchTitan 0.3 runs unchanged on CPU (gloo) and on GPUs.

Each shim keys on what is missing (no accelerator, an absent API, the gloo backend),
never on a hard-coded version, so on a CUDA machine with a newer torch they are no-ops.
`install()` must run before torchtitan's metrics / distributed / profiler modules are
imported, because they copy `device_type` and `device_module` at import time.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

_installed = False


def _cpu_device_module() -> SimpleNamespace:
    """The subset of the torch.cuda API TorchTitan calls, answered for the host CPU."""

    def total_memory() -> int:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return 0

    return SimpleNamespace(
        set_device=lambda device: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *a, **k: None,
        memory_stats=lambda *a, **k: {},
        get_device_name=lambda *a, **k: "cpu",
        get_device_properties=lambda *a, **k: SimpleNamespace(
            total_memory=total_memory(), name="cpu"
        ),
        memory=SimpleNamespace(_record_memory_history=lambda *a, **k: None),
        is_available=lambda: True,
    )


def install() -> None:
    """Apply every shim this environment needs (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    if not torch.cuda.is_available():
        _use_cpu_device()
    if not hasattr(dist, "set_timeout"):
        _backport_set_timeout()
    # The pre-split pipeline `step(arg_mbs=, kwarg_mbs=, target_mbs=)` TorchTitan calls
    # (missing before torch 2.14) is backported in sb_titan.schedule's subclasses.


def _use_cpu_device() -> None:
    """TorchTitan defaults device_type to "cuda" when no accelerator is found."""
    already = [
        m
        for m in ("torchtitan.components.metrics", "torchtitan.distributed.utils")
        if m in sys.modules
    ]
    if already:
        raise RuntimeError(
            f"sb_titan.compat.install() ran after {already} were imported; import "
            "sb_titan before torchtitan's trainer so the CPU device shim applies"
        )
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _cpu_device_module()


def _backport_set_timeout() -> None:
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
