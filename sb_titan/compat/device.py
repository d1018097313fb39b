"""TorchTitan on a machine without an accelerator: the CPU answers its device calls.

TorchTitan picks "cuda" when it finds no accelerator (torchtitan/tools/utils.py), and its
metrics, distributed and profiler modules copy `device_type` / `device_module` at import.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch


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


def use_cpu_device() -> None:
    """TorchTitan defaults device_type to "cuda" when no accelerator is found, and its
    modules copy `device_type` / `device_module` at import: patch the source and every
    copy already made, so the shim works whatever was imported first."""
    import torchtitan.tools.utils as tt_utils

    cpu = tt_utils.device_module if tt_utils.device_type == "cpu" else _cpu_device_module()
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu
