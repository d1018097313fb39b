"""Llama 3.x's named sizes (`[model] family = "llama3"`, `flavor`): the released models'
config.json dimensions (RoPE theta 5e5, RMSNorm eps 1e-5, 131072 positions with
llama3 RoPE scaling from 8192), plus a tiny CPU one."""

from __future__ import annotations

from functools import partial

from sb_titan.models.dims import ModelDims, RopeScaling

# Llama 3.1 stretches its 8K pre-training RoPE 8x, Llama 3.2's small models 32x.
_SCALED_8 = RopeScaling("llama3", 8.0, 8192)
_SCALED_32 = RopeScaling("llama3", 32.0, 8192)
_Llama3 = partial(ModelDims, rope_theta=500_000.0, norm_eps=1e-5, family="llama3")

FLAVORS: dict[str, ModelDims] = {
    # Tiny CPU model, untied (pipeline parallelism), head_dim 64 for the kernels' shapes.
    "debug": _Llama3(256, 2, 4, 2, 64, 512, 1024, False, 32768),
    "1b": _Llama3(2048, 16, 32, 8, 64, 8192, 128256, True, rope_scaling=_SCALED_32),  # 3.2
    "3b": _Llama3(3072, 28, 24, 8, 128, 8192, 128256, True, rope_scaling=_SCALED_32),  # 3.2
    "8b": _Llama3(4096, 32, 32, 8, 128, 14336, 128256, False, rope_scaling=_SCALED_8),  # 3.1
    "70b": _Llama3(8192, 80, 64, 8, 128, 28672, 128256, False, rope_scaling=_SCALED_8),  # 3.1
}
