"""Load a trained model for evaluation: a DCP checkpoint (its config from its run record,
or a TOML that agrees with it) or an HF directory.

A TorchTitan DCP checkpoint stores the model's parameters under their own names at the
top level (next to optimizer / dataloader / train_state entries when it is a full
checkpoint), so loading asks DCP for just the model's keys; no process group is needed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from sb_titan.data.tokenizer import EOS, TOKENIZER_DIR
from sb_titan.models.attention import SparseAttentionConfig
from sb_titan.models.dims import ModelDims
from sb_titan.models.registry import hf_dims, model_dims, model_registry

_STEP = re.compile(r"^step-(\d+)$")


@dataclass
class LoadedModel:
    model: nn.Module
    dims: ModelDims
    attention: SparseAttentionConfig
    tokenizer_dir: Path
    source: str
    default_budget: float = 1.0
    """The budget a sparse evaluation uses unless told otherwise (the config's beta0)."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A step-N directory itself, or the newest step-N inside a checkpoint folder
    (dump_folder/checkpoint) or a dump folder."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    for parent in (path, path / "checkpoint"):
        steps = [
            (int(m.group(1)), p)
            for p in parent.glob("step-*")
            if (m := _STEP.match(p.name)) and (p / ".metadata").is_file()
        ]
        if steps:
            return max(steps)[1]
    raise FileNotFoundError(f"checkpoint: no DCP checkpoint (step-N/.metadata) under {path}")


def build_model(dims: ModelDims, attention: SparseAttentionConfig, flavor: str = "hf") -> nn.Module:
    spec = model_registry(flavor, attention=attention, dims=dims)
    model = spec.model.build()
    model.init_weights()  # also fills the RoPE cache buffers
    return model.eval()


def load_dcp_into(model: nn.Module, checkpoint: str | Path) -> Path:
    """Fill `model`'s parameters from a DCP checkpoint (model-only or full)."""
    import torch.distributed.checkpoint as dcp

    from sb_titan.runtime.checkpoint import MANIFEST, verify

    step_dir = resolve_checkpoint(checkpoint)
    if (step_dir / MANIFEST).is_file():  # written by training; older checkpoints lack it
        verify(step_dir)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(step_dir))
    model.load_state_dict(state, strict=True)
    return step_dir


def load_from_config(
    checkpoint: str | Path | None,
    config_path: str | Path | None = None,
    attention: str | None = None,
    cli_args: list[str] | None = None,
) -> LoadedModel:
    """The model a config trains, with weights from `checkpoint` (random if None). The
    config: the checkpoint's own run record's, or `config_path` (+ `cli_args`), which
    must then agree with the record (config/recorded.py)."""
    from sb_titan.config.recorded import checkpoint_config
    from sb_titan.config.toml import ConfigError, load_config

    if checkpoint is None:
        config = load_config(config_path, cli_args)
    else:
        checkpoint = resolve_checkpoint(checkpoint)
        config = checkpoint_config(checkpoint, config_path, cli_args)
    attn = _attention(config.sparse_attention, attention)
    flavor = config.model.flavor
    try:
        dims = model_dims(config)  # the trainer's rule: flavor, [model] overrides, HF values
    except ValueError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    model = build_model(dims, attn, flavor)
    source = f"{config_path} (random init)"
    if checkpoint is not None:
        source = str(load_dcp_into(model, checkpoint))
    return LoadedModel(
        model, dims, attn, Path(config.hf_assets_path), source, default_budget=config.dst.beta0
    )


def load_from_hf(hf_dir: str | Path, attention: str | None = None) -> LoadedModel:
    """A Hugging Face directory (config.json + *.safetensors) of any supported family
    into our model, the size its config.json describes."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    dims = hf_dims(hf_dir / "config.json")
    attn = _attention(SparseAttentionConfig(enabled=False), attention)
    spec = model_registry("hf", attention=attn, dims=dims)
    model = build_model(dims, attn)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"hf: no *.safetensors in {hf_dir}")
    hf_state: dict[str, torch.Tensor] = {}
    for f in files:
        hf_state.update(load_file(f))
    state = spec.state_dict_adapter(spec.model, str(hf_dir)).from_hf(hf_state)
    dtype = next(model.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    tok_dir = hf_dir if (hf_dir / "tokenizer.json").is_file() else TOKENIZER_DIR
    return LoadedModel(model, dims, attn, tok_dir, str(hf_dir))


def _attention(base: SparseAttentionConfig, mode: str | None) -> SparseAttentionConfig:
    """`dense` / `sparse` override of the config's [sparse_attention].enabled."""
    if mode is None:
        return base
    if mode not in ("dense", "sparse"):
        raise ValueError(f"--attention: {mode!r} is not 'dense' or 'sparse'")
    return dataclasses.replace(base, enabled=mode == "sparse")


def eos_ids(tokenizer, tokenizer_dir: Path) -> list[int]:
    """End-of-sequence ids: generation_config.json's, else tokenizer_config's eos_token."""
    gen = tokenizer_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [int(eos)]
    names = [EOS]
    cfg = tokenizer_dir / "tokenizer_config.json"
    if cfg.is_file():
        tok = json.loads(cfg.read_text()).get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok:
            names.insert(0, tok)
    return sorted({i for n in names if (i := tokenizer.token_to_id(n)) is not None})
