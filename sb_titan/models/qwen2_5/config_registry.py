"""TorchTitan's own launch of the recipe, by its config-registry convention:

    torchrun --nproc_per_node=2 -m torchtitan.train \
        --module sb_titan.models.qwen2_5 --config sb_titan_debug [--training.steps 2 ...]

TorchTitan imports this module by name; each function returns a full trainer config.
Like every entry point it installs the compatibility shims itself (importing sb_titan has
no side effects). This file is an entry point: it sits beside its model, as TorchTitan's
do, but belongs to the tools layer (docs/architecture.md).
"""

from __future__ import annotations

import torch

from sb_titan import compat
from sb_titan.config.defaults import sb_titan_base
from sb_titan.runtime.console import install_log_filter


def sb_titan_debug():
    """The tiny debug Qwen2.5 on the bundled synthetic corpus (CPU friendly)."""
    compat.install()
    install_log_filter(on_cpu=not torch.cuda.is_available())  # TorchTitan's harmless messages
    return sb_titan_base()
