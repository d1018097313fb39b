"""Qwen2.5's named sizes (`[model] family = "qwen2_5"`, `flavor`): the released models'
config.json dimensions, RoPE theta 1e6 and RMSNorm eps 1e-6, plus tiny CPU ones."""

from __future__ import annotations

from sb_titan.models.dims import ModelDims

FLAVORS: dict[str, ModelDims] = {
    # Tiny CPU model; head_dim 64 like 0.5B so the sparse kernels' shapes are real.
    # Untied so that pipeline parallelism works out of the box.
    "debug": ModelDims(256, 2, 4, 2, 64, 512, 1024, False, 32768),
    # The same with 4 layers: multi-token key -> value recall needs composed offset heads
    # that 2 layers of 4 heads did not learn in CPU time (bench/accuracy.py's base).
    "debug4": ModelDims(256, 4, 4, 2, 64, 512, 1024, False, 32768),
    # Published Qwen2.5 dimensions (Hugging Face config.json).
    "0.5b": ModelDims(896, 24, 14, 2, 64, 4864, 151936, True),
    "1.5b": ModelDims(1536, 28, 12, 2, 128, 8960, 151936, True),
    "3b": ModelDims(2048, 36, 16, 2, 128, 11008, 151936, True),
    "7b": ModelDims(3584, 28, 28, 4, 128, 18944, 152064, False),
}
