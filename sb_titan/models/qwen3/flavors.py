"""Qwen3 dense's named sizes (`[model] family = "qwen3"`, `flavor`): the released
models' config.json dimensions (head_dim 128 set explicitly, 40960 positions, RoPE theta
1e6, RMSNorm eps 1e-6), plus a tiny CPU one."""

from __future__ import annotations

from functools import partial

from sb_titan.models.dims import ModelDims

_Qwen3 = partial(ModelDims, max_seq_len=40960, family="qwen3")

FLAVORS: dict[str, ModelDims] = {
    # Tiny CPU model, untied (pipeline parallelism), head_dim 64 for the kernels' shapes.
    "debug": _Qwen3(256, 2, 4, 2, 64, 512, 1024, False, max_seq_len=32768),
    "0.6b": _Qwen3(1024, 28, 16, 8, 128, 3072, 151936, True),
    "1.7b": _Qwen3(2048, 28, 16, 8, 128, 6144, 151936, True),
    "4b": _Qwen3(2560, 36, 32, 8, 128, 9728, 151936, True),
    "8b": _Qwen3(4096, 36, 32, 8, 128, 12288, 151936, False),
    "14b": _Qwen3(5120, 40, 40, 8, 128, 17408, 151936, False),
    "32b": _Qwen3(5120, 64, 64, 8, 128, 25600, 151936, False),
}
