"""`sb-export`: a trained DCP checkpoint -> a Hugging Face directory (Qwen2, Qwen3 or Llama).

    sb-export --checkpoint outputs/debug_cpu/checkpoint --out exported/debug

The checkpoint's own config (its run record) gives the model's shape; `--config X.toml`
is accepted if it agrees with it, and is needed for a checkpoint saved without one.

Writes model.safetensors (names through the family's state-dict adapter), the family's
transformers config.json (Qwen2Config, Qwen3Config or LlamaConfig, RoPE scaling
included), generation_config.json and the tokenizer files, so that
`transformers.AutoModelForCausalLM.from_pretrained(out)` and `sb-eval --hf out` work.
Sparse attention is a training/inference *method*, not weights: the export is a plain
dense model of its family.
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

    from sb_titan.models.dims import ModelDims

DTYPES = ("bfloat16", "float16", "float32")  # torch dtypes the weights can be saved in


def hf_config(dims: ModelDims, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' class of the model's family."""
    from sb_titan.models.hf_config import hf_model_config
    from sb_titan.models.registry import FAMILIES

    model = hf_model_config(dims, FAMILIES[dims.family])
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    return model | ids | {"torch_dtype": dtype, "dtype": dtype}


def export_model(
    model: torch.nn.Module, dims: ModelDims, out: Path, dtype: str = "float32"
) -> Path:
    """Write model.safetensors for `model` (built from `dims`) into `out`."""
    import torch
    from safetensors.torch import save_file

    from sb_titan.models.registry import model_registry

    spec = model_registry("hf", dims=dims)
    adapter = spec.state_dict_adapter(spec.model, None)
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
