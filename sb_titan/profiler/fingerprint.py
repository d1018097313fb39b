"""What a profile must have been measured on to describe a run: device, software,
model dimensions and the stage's modules. The trainer checks it on load."""

from __future__ import annotations

from typing import Any

import torch

from sb_titan.attention.backends import resolve_backend
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


def current_fingerprint(
    config: Any,
    stage: int = 0,
    device: torch.device | str | None = None,
    scope: str = "blocks",
) -> dict[str, Any]:
    """What a profile must have been measured on to describe this run.

    The trainer passes it to CostModel.check_fingerprint. Every rank checks against
    the same stage (the one whose profile DST uses), not its own; `scope` is what the
    trainer's clock measures (decoder blocks, sb_titan/measure.py).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modules = scoped_modules(stage_module_names(config, stage), scope)
    model_cfg = config.model_spec.model
    attn = model_cfg.layers[0].attention
    layers = layer_ids(modules)
    dense = [i for i in layers if not model_cfg.layers[i].attention.inner_attention.sparse]
    fp = {
        "device_type": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(profile_dtype(config, device)).removeprefix("torch."),
        "attention_backend": resolve_backend(config.sparse_attention.backend, device.type),
        "block_size": config.sparse_attention.block_size,
        "flavor": config.model.flavor,
        "hidden": model_cfg.dim,
        "heads": attn.n_heads,
        "kv_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate": model_cfg.layers[0].feed_forward.w1.out_features,
        "vocab_size": model_cfg.vocab_size,
        "layers": len(model_cfg.layers),
        "pp_degree": config.parallelism.pipeline_parallel_degree,
        "pp_stage": stage,
        "scope": scope,
        "stage_modules": modules,
        "stage_dense_layers": dense,
        "row_len": config.training.seq_len,
    }
    if device.type == "cpu":
        fp["cpu_threads"] = torch.get_num_threads()
    return fp
