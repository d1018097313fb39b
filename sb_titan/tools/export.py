"""`sb-export`: a trained DCP checkpoint -> a Hugging Face Qwen2.5 directory.

    sb-export --checkpoint outputs/debug_cpu/checkpoint --out exported/debug

The checkpoint's own config (its run record) gives the model's shape; `--config X.toml`
is accepted if it agrees with it, and is needed for a checkpoint saved without one.

Writes model.safetensors (names through Qwen25StateDictAdapter.to_hf), a transformers
Qwen2Config config.json, generation_config.json and the tokenizer files, so that
`transformers.AutoModelForCausalLM.from_pretrained(out)` and `sb-eval --hf out` work.
Sparse attention is a training/inference *method*, not weights: the export is a plain
dense Qwen2 model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the model are imported by the work, not by --help
    import torch

    from sb_titan.models.qwen2_5 import Qwen25Dims

DTYPES = ("bfloat16", "float16", "float32")  # torch dtypes the weights can be saved in


def hf_config(dims: Qwen25Dims, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' Qwen2ForCausalLM (v4 and v5 rope fields both set)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": dims.dim,
        "intermediate_size": dims.hidden_dim,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab_size,
        "max_position_embeddings": dims.max_seq_len,
        "rms_norm_eps": dims.norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": dims.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": dims.n_layers,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def export_model(
    model: torch.nn.Module, dims: Qwen25Dims, out: Path, dtype: str = "float32"
) -> Path:
    """Write model.safetensors + config.json for `model` (a built Qwen2.5) into `out`."""
    import torch
    from safetensors.torch import save_file

    from sb_titan.models.qwen2_5 import model_registry
    from sb_titan.models.qwen2_5.state_dict_adapter import Qwen25StateDictAdapter

    if dims.head_dim * dims.n_heads != dims.dim:
        print(
            f"sb-export: note: head_dim {dims.head_dim} x {dims.n_heads} heads != hidden "
            f"{dims.dim}; config.json sets head_dim explicitly (needs a transformers that reads it)"
        )
    spec = model_registry("hf", dims=dims)
    adapter = Qwen25StateDictAdapter(spec.model, None)
    hf_state = adapter.to_hf({k: v.detach() for k, v in model.state_dict().items()})
    # safetensors refuses shared storage; untied copies are exact and contiguous.
    to = getattr(torch, dtype)
    hf_state = {k: v.to(to).contiguous().clone() for k, v in hf_state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> tuple[int | None, int | None]:
    """Copy the tokenizer files; returns (bos_id, eos_id) for config.json."""
    from sb_titan.data.tokenizer import BOS, EOS, load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    try:
        tok = load_tokenizer(tokenizer_dir)
    except FileNotFoundError:
        return None, None
    return tok.token_to_id(BOS), tok.token_to_id(EOS)


def export_folder(loaded, out: Path, dtype: str = "float32") -> Path:
    """A loaded model (eval.checkpoint.LoadedModel) -> a complete Hugging Face folder:
    weights, tokenizer, config.json and generation_config.json."""
    export_model(loaded.model, loaded.dims, out, dtype)
    bos, eos = copy_tokenizer(loaded.tokenizer_dir, out)
    config = hf_config(loaded.dims, dtype, bos, eos)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sb-export", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint", required=True, help="DCP step-N dir, or a checkpoint/dump folder"
    )
    parser.add_argument(
        "--config", help="TOML the checkpoint was trained with (default: its own run record)"
    )
    parser.add_argument("--out", required=True, help="output Hugging Face directory")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    args = parser.parse_args(argv)

    from sb_titan.config.toml import ConfigError
    from sb_titan.eval.checkpoint import load_from_config

    try:
        loaded = load_from_config(args.checkpoint, args.config, attention="dense")
    except ConfigError as e:
        sys.exit(f"sb-export: error: {e}")
    out = Path(args.out)
    export_folder(loaded, out, args.dtype)
    n = sum(p.numel() for p in loaded.model.parameters())
    print(f"sb-export: {loaded.source} -> {out} ({n / 1e6:.1f}M parameters, {args.dtype})")


if __name__ == "__main__":
    main()
