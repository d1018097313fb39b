"""Pieces shared by the Triton kernel files: tile configs, launch options, the checking flag.

`SB_TRITON_UPCAST=1` makes every `tl.dot` run on fp32 operands (IEEE): the kernels cast
their dot operands to fp32 right after loading them (constexpr `DOT_F32`). It exists for
`TRITON_INTERPRET=1`, whose numpy `tl.dot` is wrong for bf16 operands; on a GPU it only
costs speed. It is read once at import, like Triton reads `TRITON_INTERPRET`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

UPCAST: bool = os.environ.get("SB_TRITON_UPCAST", "0") == "1"

#: softmax runs in base 2 (exp2 is one instruction); scores are pre-scaled by log2(e)
LOG2E = 1.4426950408889634

#: FP fusion (FMA contraction) passed explicitly to every launch and AOT compile, so the
#: two agree whatever TRITON_DEFAULT_FP_FUSION says (its default flips in Triton 3.10).
FP_FUSION: bool = True

#: dtypes with shipped (AOT-checked) tile configs; fp32 runs with a derived config.
SHIPPED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
SHIPPED_HEAD_DIMS: tuple[int, ...] = (64, 128)
SHIPPED_BLOCK_SIZES: tuple[int, ...] = (64, 128)

TRITON_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}


def config_dtype(dtype: torch.dtype) -> str | None:
    """Tile-table key of an input dtype; fp32 (checking only) borrows the bf16 entry."""
    return "bf16" if dtype == torch.float32 else TRITON_DTYPE_NAMES.get(dtype)


class Tile(NamedTuple):
    """Launch config of one kernel: tile rows/cols plus Triton's warps and stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should run `tl.dot` on fp32 operands with IEEE precision."""
    return UPCAST or dtype == torch.float32


def fp32_variant(tile: Tile) -> Tile:
    """fp32 inputs (checking only) double the operand bytes: single stage, same tiles."""
    return tile._replace(num_stages=1)


def launch_opts(tile: Tile) -> dict[str, object]:
    """Compile options of a launch; AOT passes the very same dict to triton.compile."""
    return dict(num_warps=tile.num_warps, num_stages=tile.num_stages, enable_fp_fusion=FP_FUSION)
