"""Tile table of the block-sparse attention kernels, one for runtime and AOT.

(dtype, head_dim, block size Bs) -> the tile of each kernel family. The launchers
(attn_fwd.py, attn_bwd_dq.py, attn_bwd_dkdv.py) and aot.py read the same entries, so
what ships is what the AOT report checked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import Tile, config_dtype, fp32_variant


class AttnTiles(NamedTuple):
    """Tile configs of the four attention kernels for one (dtype, head_dim, Bs)."""

    fwd: Tile
    preprocess: Tile
    dq: Tile
    dkdv: Tile


# One table for runtime and AOT: (dtype name, head_dim, block size Bs) -> tiles. Tiles
# divide Bs so every tile lies inside one sparse block. Picked by the AOT sweep
# `python bench/kernels_report.py --sweep` (bf16, sm_80 and sm_90a, see docs/kernels.md):
# among tiles with no spills, shared memory within the limit and no duplicated MMA work
# (mma_ratio 1: with 8 warps on a 64-row tile of chained dots, Triton lays the warps
# along M only and two warp groups issue the same MMAs) on both arches, the largest
# tile area, then the larger resident dimension, then fewer warps, then more stages.
_PRE = Tile(64, 0, 4, 1)
#: the dK/dV partial sum: a streaming add over BLOCK_N x D tiles (BLOCK_N is dK/dV's)
REDUCE_TILE = Tile(0, 0, 8, 1)
_BY_SHAPE: dict[tuple[int, int], AttnTiles] = {
    (64, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 64, 4, 3), dkdv=Tile(64, 32, 4, 3)
    ),
    (64, 128): AttnTiles(
        fwd=Tile(128, 128, 8, 3), preprocess=_PRE, dq=Tile(128, 64, 8, 3), dkdv=Tile(32, 128, 8, 3)
    ),
    (128, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 64, 4, 3), dkdv=Tile(64, 32, 8, 3)
    ),
    (128, 128): AttnTiles(
        fwd=Tile(128, 64, 8, 3), preprocess=_PRE, dq=Tile(128, 32, 8, 3), dkdv=Tile(64, 32, 8, 3)
    ),
}
ATTN_CONFIGS: dict[tuple[str, int, int], AttnTiles] = {
    (dt, d, bs): tiles for dt in ("bf16", "fp16") for (d, bs), tiles in _BY_SHAPE.items()
}


def attn_tiles(dtype: torch.dtype, head_dim: int, block_size: int) -> AttnTiles:
    """Tiles for a launch; fp32 (checking only) reuses the bf16 tiles with one stage."""
    name = config_dtype(dtype)
    key = (name, head_dim, block_size)
    if name is None or key not in ATTN_CONFIGS:
        raise ValueError(f"no tile config for dtype={dtype} head_dim={head_dim} Bs={block_size}")
    tiles = ATTN_CONFIGS[key]
    for t in (tiles.fwd, tiles.dq, tiles.dkdv):
        assert block_size % t.block_m == 0 and block_size % t.block_n == 0, (key, t)
    if dtype == torch.float32:
        tiles = AttnTiles(*(fp32_variant(t) for t in tiles))
    return tiles
