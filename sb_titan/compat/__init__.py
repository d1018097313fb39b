"""Every touch of a private or version-specific torch / TorchTitan API, in one place.

Each shim keys on what is missing (no accelerator, an absent API, the gloo backend),
never on a hard-coded version, so on a CUDA machine with a newer torch they are no-ops.
Nothing here runs at import: entry points call `install()` (sb-train, the tools, the
TorchTitan-native launch through config_registry), and import order does not matter.

    autograd.py     whether autograd is running a backward (recompute detection)
    device.py       TorchTitan's device handling on a machine without an accelerator
    distributed.py  set_timeout backport; gloo's missing PREMUL_SUM under FSDP
    pipelining.py   the pre-split pipeline step() (torch < 2.14); a schedule's settings
"""

from __future__ import annotations

import torch

from sb_titan.compat.device import use_cpu_device
from sb_titan.compat.distributed import backport_set_timeout, force_sum_reduction_on_gloo

__all__ = ["force_sum_reduction_on_gloo", "install"]


def install() -> None:
    """Apply every shim this environment needs (idempotent, any import order)."""
    if not torch.cuda.is_available():
        use_cpu_device()
    backport_set_timeout()
