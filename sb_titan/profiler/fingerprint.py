"""What a profile must have been measured on to describe a run: device, software,
model dimensions and the stage's modules. The trainer checks it on load."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torchtitan.models.qwen3.model import Qwen3Model

from sb_titan.attention.backends import resolve_backend
from sb_titan.models.registry import family_of_decoder
from sb_titan.profiler.sections import ProfiledSections
from sb_titan.profiler.stage import (
    device_name,
    layer_ids,
    profile_dtype,
    scoped_modules,
    stage_module_names,
)


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def nvidia_driver(version_file: str | Path = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's version (torch has no public call for it); None
    where the file is absent or says no version."""
    try:
        text = Path(version_file).read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \w+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def current_fingerprint(
    config: ProfiledSections,
    model: Qwen3Model.Config,
    stage: int = 0,
    device: torch.device | str | None = None,
    scope: str = "blocks",
) -> dict[str, Any]:
    """What a profile must have been measured on to describe this run, whose model spec
    (derived from `config`) builds `model`.

    The trainer passes it to CostModel.check_fingerprint. Every rank checks against
    the same stage (the one whose profile DST uses), not its own; `scope` is what the
    trainer's clock measures (decoder blocks, sb_titan/measure.py).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modules = scoped_modules(stage_module_names(config.parallelism, model, stage), scope)
    attn = model.layers[0].attention
    layers = layer_ids(modules)
    dense = [i for i in layers if not model.layers[i].attention.inner_attention.sparse]
    fp = {
        "device_type": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(profile_dtype(config.training, device)).removeprefix("torch."),
        "attention_backend": resolve_backend(config.sparse_attention.backend, device.type),
        "block_size": config.sparse_attention.block_size,
        "family": family_of_decoder(model),
        "flavor": config.model.flavor,
        "hidden": model.dim,
        "heads": attn.n_heads,
        "kv_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate": model.layers[0].feed_forward.w1.out_features,
        "vocab_size": model.vocab_size,
        "layers": len(model.layers),
        "pp_degree": config.parallelism.pipeline_parallel_degree,
        "pp_stage": stage,
        "scope": scope,
        "stage_modules": modules,
        "stage_dense_layers": dense,
        "row_len": config.training.seq_len,
    }
    if device.type == "cpu":
        fp["cpu_threads"] = torch.get_num_threads()
    elif device.type == "cuda":  # the software below torch: differences warn, like torch
        fp["cuda"] = torch.version.cuda
        fp["driver"] = nvidia_driver()
    return fp
