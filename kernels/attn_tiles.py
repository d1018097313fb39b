"""Tile tables of the block-sparse attention kernels, one per arch, for runtime and AOT.

(table, dtype, head_dim, block size Bs) -> the tile of each kernel family. A launch
takes the table of its device (`tile_table`: sm_90a on Hopper, sm_80 elsewhere) unless
SB_TRITON_TILES names one; "common" is the table chosen for both arches at once, kept
for comparison, and "sm_90a_mma_sync" the sm_90a table before its last mma.sync tile
moved to wgmma. The launchers (attn_fwd.py, attn_bwd_dq.py, attn_bwd_dkdv.py) and
aot.py read the same entries, so what ships is what the AOT report checked.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .common import Tile, config_dtype, fp32_variant


class AttnTiles(NamedTuple):
    """Tile configs of the four attention kernels for one (dtype, head_dim, Bs)."""

    fwd: Tile
    preprocess: Tile
    dq: Tile
    dkdv: Tile


# Tiles divide Bs so every tile lies inside one sparse block. Picked by the AOT sweep
# `python bench/kernels_report.py --sweep [--arch ARCH]` (bf16, see docs/kernels.md):
# among tiles with no spills, shared memory within the limit and no duplicated MMA work
# (mma_ratio 1: with 8 warps on a 64-row tile of chained dots, Triton lays the warps
# along M only and two warp groups issue the same MMAs), on sm_90a tiles that issue
# wgmma first, then the largest tile area, then the larger resident dimension, then
# (sm_90a) more CTAs per SM, then fewer warps, then more stages.
_PRE = Tile(64, 0, 4, 1)
#: the dK/dV partial sum: a streaming add over BLOCK_N x D tiles (BLOCK_N is dK/dV's)
REDUCE_TILE = Tile(0, 0, 8, 1)
#: "common": one tile that passes on sm_80 and sm_90a alike (the only table before the
#: per-arch ones); on sm_90a its 32-key-row dK/dV tiles (D=64 Bs=64, and D=128) run
#: Ampere's mma.sync
_COMMON: dict[tuple[int, int], AttnTiles] = {
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
#: sm_80 alone: the pick rule over the sm_80 rows of the joint sweep (kernels_sweep.json,
#: Triton 3.9; the two changed tiles also pass with 3.6) is the common table except at
#: D=128, Bs=128, where dQ and dK/dV get twice the area (they spill or duplicate MMAs
#: on sm_90a, not on sm_80)
_SM80: dict[tuple[int, int], AttnTiles] = {
    **_COMMON,
    (128, 128): AttnTiles(
        fwd=Tile(128, 64, 8, 3), preprocess=_PRE, dq=Tile(64, 128, 8, 2), dkdv=Tile(64, 64, 8, 2)
    ),
}
#: sm_90a alone (`--sweep --arch sm_90a --and-sweep <Triton 3.6's sweep>`): every tile
#: issues wgmma and passes on Triton 3.9 and 3.6. At D=128, Bs=64 the sweep (doc-id
#: mask) found no spill-free wgmma dK/dV tile; with the bounds mask 16x64, 4 warps,
#: 2 stages is spill-free on both (`--masks`), and dK/dV there ships that
_SM90A: dict[tuple[int, int], AttnTiles] = {
    (64, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 2), preprocess=_PRE, dq=Tile(64, 64, 4, 2), dkdv=Tile(32, 64, 4, 3)
    ),
    (64, 128): AttnTiles(
        fwd=Tile(128, 128, 8, 3), preprocess=_PRE, dq=Tile(128, 128, 8, 3), dkdv=Tile(64, 128, 8, 3)
    ),
    (128, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 64, 4, 2), dkdv=Tile(16, 64, 4, 2)
    ),
    (128, 128): AttnTiles(
        fwd=Tile(128, 64, 8, 3), preprocess=_PRE, dq=Tile(128, 64, 8, 3), dkdv=Tile(16, 128, 8, 3)
    ),
}
#: the sm_90a table before, kept as the alternative: dK/dV at D=128, Bs=64 on the
#: common mma.sync tile 64x32, 8 warps, 3 stages (1 CTA per SM against the wgmma
#: tile's 2). Which of the two is faster needs a GPU
_SM90A_MMA_SYNC: dict[tuple[int, int], AttnTiles] = {
    **_SM90A,
    (128, 64): _SM90A[(128, 64)]._replace(dkdv=_COMMON[(128, 64)].dkdv),
}
#: table name -> (head_dim, Bs) -> tiles. A table named `<arch>_<variant>` is an
#: alternative for that arch (aot.arch_tables checks it there)
TILE_TABLES: dict[str, dict[tuple[int, int], AttnTiles]] = {
    "sm_80": _SM80,
    "sm_90a": _SM90A,
    "sm_90a_mma_sync": _SM90A_MMA_SYNC,
    "common": _COMMON,
}
#: the MMA each sm_90a table promises on sm_90a: wgmma in every kernel, except the
#: (kernel field, head_dim, Bs) listed here, which run mma.sync on purpose (docs/
#: kernels.md lists the candidates tried). tests/test_kernels.py checks it in the
#: reports' PTX. sm_80 and common promise nothing there
SM90A_MMA_SYNC: dict[str, frozenset[tuple[str, int, int]]] = {
    "sm_90a": frozenset(),
    "sm_90a_mma_sync": frozenset({("dkdv", 128, 64)}),
}
#: (table, kernel field, head_dim, Bs) whose kernel masks partial tiles by document ids;
#: everywhere else by document bounds (BOUNDS_MASK: no doc-id load per masked tile).
#: `python bench/kernels_report.py --masks` (Triton 3.9 and 3.6) compiles both and lists
#: these: where bounds would cost CTAs per SM or spill on an arch the table runs on.
#: dK/dV 32x128 (D=64 Bs=128) spills 8-16 bytes on sm_80, 64x128 8 bytes on sm_90a
#: (3.6); the forward and dQ 64x64 with 3 stages (D=64 Bs=64) drop from 3 to 2 CTAs per
#: SM on sm_90a (3.6: +14 registers)
DOC_ID_MASK: frozenset[tuple[str, str, int, int]] = frozenset(
    {
        ("common", "dkdv", 64, 128),
        ("common", "dq", 64, 64),
        ("common", "fwd", 64, 64),
        ("sm_80", "dkdv", 64, 128),
        ("sm_90a", "dkdv", 64, 128),
        ("sm_90a_mma_sync", "dkdv", 64, 128),
    }
)
#: the two ways a kernel masks a partial tile (kernels/attn_common.py: row_keep, col_keep)
MASKS = ("bounds", "doc_id")
ATTN_CONFIGS: dict[tuple[str, str, int, int], AttnTiles] = {
    (table, dt, d, bs): tiles
    for table, by_shape in TILE_TABLES.items()
    for dt in ("bf16", "fp16")
    for (d, bs), tiles in by_shape.items()
}
#: names a table for every launch (e.g. "common"); unset or "auto": by the device
TILES_ENV = "SB_TRITON_TILES"
#: names a mask for every launch ("bounds" or "doc_id"); unset or "auto": the table's
MASK_ENV = "SB_TRITON_MASK"


def tile_table(device: torch.device) -> str:
    """The table a launch on `device` takes: SB_TRITON_TILES when set, else sm_90a on
    compute capability 9.x (wgmma) and sm_80 anywhere else (Ampere and later, and the
    interpreter's CPU tensors). Read at every launch, so a process can switch tables."""
    name = os.environ.get(TILES_ENV, "auto")
    if name == "auto":
        cuda = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        return "sm_90a" if cuda else "sm_80"
    if name not in TILE_TABLES:
        raise ValueError(f"{TILES_ENV}={name!r}: expected auto or one of {sorted(TILE_TABLES)}")
    return name


def attn_tiles(dtype: torch.dtype, head_dim: int, block_size: int, table: str) -> AttnTiles:
    """Tiles for a launch; fp32 (checking only) reuses the bf16 tiles with one stage."""
    name = config_dtype(dtype)
    key = (table, name, head_dim, block_size)
    if name is None or key not in ATTN_CONFIGS:
        raise ValueError(
            f"no tile config for table={table} dtype={dtype} head_dim={head_dim} Bs={block_size}"
        )
    tiles = ATTN_CONFIGS[key]
    for t in (tiles.fwd, tiles.dq, tiles.dkdv):
        assert block_size % t.block_m == 0 and block_size % t.block_n == 0, (key, t)
    if dtype == torch.float32:
        tiles = AttnTiles(*(fp32_variant(t) for t in tiles))
    return tiles


def table_mask(table: str, field: str, head_dim: int, block_size: int) -> str:
    """The mask ("bounds" or "doc_id") tile table `table` ships for one kernel field."""
    return "doc_id" if (table, field, head_dim, block_size) in DOC_ID_MASK else "bounds"


def bounds_mask(table: str, field: str, head_dim: int, block_size: int) -> bool:
    """BOUNDS_MASK of a launch: SB_TRITON_MASK when set, else the table's choice. Read at
    every launch, so a process (the interpreter tests) can run both masks."""
    name = os.environ.get(MASK_ENV, "auto")
    if name == "auto":
        name = table_mask(table, field, head_dim, block_size)
    elif name not in MASKS:
        raise ValueError(f"{MASK_ENV}={name!r}: expected auto or one of {list(MASKS)}")
    return name == "bounds"
