"""Every touch of a private or version-specific torch / TorchTitan API, in one place.

Each shim keys on what is missing (no accelerator, an absent API, the gloo backend),
never on a hard-coded version, so on a CUDA machine with a newer torch they are no-ops.
Nothing here runs at import: entry points call `install()` (sb-train, the tools, the
TorchTitan-native launch through config_registry), and import order does not matter.

    autograd.py     whether autograd is running a backward (recompute detection)
    checkpoint.py   TorchTitan's checkpoint manager (its new home) and its private
                    save / load / purge steps as public hooks
    data.py         TorchTitan's data-loader base class (0.3.0, main, or the contract);
                    stopping a torchdata Prefetcher's thread
    device.py       TorchTitan's device handling on a machine without an accelerator
    distributed.py  set_timeout backport; gloo's missing PREMUL_SUM under FSDP; the
                    functional collectives
    forkserver.py   stopping multiprocessing's forkserver (sb-launch's rank server)
    metrics.py      which rank TorchTitan's metrics loggers write on
    models.py       TorchTitan's decoder returning hidden states (no lm_head)
    pipelining.py   the pre-split pipeline step() (torch < 2.14); a schedule's settings;
                    its shape-inference forward; Interleaved1F1B's order; TorchTitan's
                    stage split

tests/test_private_api_fence.py fails on a private touch anywhere else.
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
