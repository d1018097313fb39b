"""The pipeline stage a profile measures: its modules, split exactly as TorchTitan's
pipeline_llm splits the model, built alone on the device, with a stand-in for its
inner attention when only the token-linear part is timed."""

from __future__ import annotations

import contextlib
import copy
import platform
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn as nn
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.models.qwen3.model import Qwen3Model

from sb_titan.compat.pipelining import llm_stage_modules, pipeline_metadata
from sb_titan.models.attention import SBAttention

CPU_MAX_STAGE_PARAMS = 60_000_000  # beyond this a CPU grid takes hours, not minutes


SCOPES = ("blocks", "stage")


_IO_MODULES = ("tok_embeddings", "norm", "lm_head")


class ProfilerError(ValueError):
    """A profiling request that cannot run here; the message says what to change."""


def stage_module_names(p: ParallelismConfig, model: Qwen3Model.Config, stage: int) -> list[str]:
    """Module FQNs of pipeline stage `stage` of `model` (the run's model spec's) under
    `[parallelism]` `p`, split exactly as TorchTitan's pipeline_llm splits the model
    (first/last stage carry the embedding/head and fewer layers)."""
    n_layers = len(model.layers)
    if p.pipeline_parallel_degree <= 1:
        if stage != 0:
            raise ProfilerError(f"--stage {stage}: the config has no pipeline parallelism")
        return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "lm_head"]
    parts = p.module_fqns_per_model_part
    if parts is None:
        try:
            meta = pipeline_metadata(p.pipeline_parallel_degree, p, model)
            parts = llm_stage_modules(*meta)
        except ValueError as e:
            raise ProfilerError(f"[parallelism] {e}") from None
    if not 0 <= stage < len(parts):
        raise ProfilerError(f"--stage {stage}: the pipeline has stages 0..{len(parts) - 1}")
    return list(parts[stage])


def layer_ids(modules: Sequence[str]) -> list[int]:
    return [int(m.split(".")[1]) for m in modules if m.startswith("layers.")]


def scoped_modules(modules: Sequence[str], scope: str) -> list[str]:
    """The modules a profile of `scope` times."""
    if scope not in SCOPES:
        raise ProfilerError(f"--scope: {scope!r} is not one of {SCOPES}")
    return [m for m in modules if scope == "stage" or m not in _IO_MODULES]


def stage_params(model: Qwen3Model.Config, modules: Sequence[str]) -> int:
    """Parameters of the modules, counted on the meta device (allocates nothing)."""
    with torch.device("meta"):
        built = model.build()
    return sum(
        p.numel()
        for name, p in built.named_parameters()
        if any(name == m or name.startswith(m + ".") for m in modules)
    )


def check_supported(
    flavor: str, model: Qwen3Model.Config, modules: Sequence[str], device: torch.device
) -> None:
    """Refuse a stage of `model` (model.flavor `flavor`) this device cannot profile in
    reasonable time or memory."""
    n = stage_params(model, modules)
    if device.type == "cpu" and n > CPU_MAX_STAGE_PARAMS:
        raise ProfilerError(
            f"model.flavor {flavor!r}: the stage has {n / 1e6:.0f}M parameters, too many to "
            f"profile on CPU (limit {CPU_MAX_STAGE_PARAMS / 1e6:.0f}M: the grid would take "
            "hours). Profile it on its target GPU, or use a smaller flavor here "
            "(--model.flavor debug)."
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = n * 16  # weights, grads and fp32 copies, with room for activations
        if need > free:
            raise ProfilerError(
                f"model.flavor {flavor!r}: the stage ({n / 1e6:.0f}M parameters) needs about "
                f"{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free on {device_name(device)}. "
                "Use a smaller flavor or more pipeline stages."
            )


def build_stage(
    training: TrainingConfig,
    model_cfg: Qwen3Model.Config,
    modules: Sequence[str],
    device: torch.device,
) -> nn.Module:
    """The listed modules of `model_cfg` (the run's model spec's) only, on `device`, with
    topk selection (exact densities)."""
    model_cfg = copy.deepcopy(model_cfg)
    for layer in model_cfg.layers:
        layer.attention.inner_attention.policy = PROFILE_POLICY
    with torch.device("meta"):
        model = model_cfg.build()
    keep = set(modules)
    for name in [n for n in model.layers if f"layers.{n}" not in keep]:
        del model.layers[name]
    for name in _IO_MODULES:
        if name not in keep:
            setattr(model, name, None)
    model.enable_weight_tying = model.enable_weight_tying and {"tok_embeddings", "lm_head"} <= keep
    model.to_empty(device=device)
    dtype = profile_dtype(training, device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
        for p in model.parameters():  # as FSDP's mixed precision: parameters, not buffers
            p.data = p.data.to(dtype)
    return model


def attention_kinds(model: nn.Module) -> list[tuple[SBAttention, int]]:
    """One representative per kind (dense, sparse) of the stage's inner attentions, and
    how many layers of that kind the stage has."""
    modules = [m for m in model.modules() if isinstance(m, SBAttention)]
    kinds = []
    for sparse in (False, True):
        same = [m for m in modules if m.config.sparse == sparse]
        if same:
            kinds.append((same[0], len(same)))
    return kinds


class TokenLinearAttention(nn.Module):
    """Stand-in inner attention for the linear measurement: O(tokens) work, and
    gradients reach q, k and v, so every projection's backward still runs."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False):
        return q + (k + v).repeat_interleave(q.shape[2] // k.shape[2], dim=2)


@contextlib.contextmanager
def attention_swapped(model: nn.Module, stand_in: nn.Module) -> Iterator[None]:
    """Temporarily replace every layer's inner attention by `stand_in`."""
    owners = [
        m for m in model.modules() if isinstance(getattr(m, "inner_attention", None), nn.Module)
    ]
    saved = [m.inner_attention for m in owners]
    for m in owners:
        m.inner_attention = stand_in
    try:
        yield
    finally:
        for m, inner in zip(owners, saved, strict=True):
            m.inner_attention = inner


PROFILE_POLICY = "topk"  # realised density == budget (above the forced blocks)


def profile_dtype(training: TrainingConfig, device: torch.device) -> torch.dtype:
    """The compute dtype of training: FSDP's param dtype on GPU, fp32 on CPU."""
    if device.type == "cpu":
        return torch.float32
    name = training.mixed_precision_param
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ProfilerError(f"training.mixed_precision_param: unknown dtype {name!r}")
    return dtype


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
