"""Triton kernels of sb_titan (shipped as `sb_titan_kernels`): block-sparse attention
forward/backward over a compressed block table, and the block-mass estimator.

Each kernel file holds its PyTorch reference beside it. Nothing here imports sb_titan
(imports run model -> attention -> kernels). `sb_titan_kernels.aot` (ahead-of-time
compilation and resource checks) is tooling and is not imported here.
"""

from .block_max import BLOCK_MAX_CONFIGS, block_max_int4_triton, block_max_triton
from .block_max_naive import Int4Codes, block_max_int4_ref, block_max_ref, int4_codes
from .block_sparse_attn import (
    ATTN_CONFIGS,
    BlockSparseAttnFn,
    BlockTable,
    attn_tiles,
    block_sparse_attention_ref,
    block_sparse_attention_triton,
    block_sparse_backward_triton,
    block_sparse_forward_triton,
    table_block_size,
    table_token_mask,
)
from .common import UPCAST, Tile
from .estimator import (
    EST_CONFIGS,
    block_probs_ref,
    block_probs_triton,
    est_tiles,
    estimate_block_mass_ref,
    estimate_block_mass_triton,
    pool_blocks_ref,
    pool_blocks_triton,
)

__all__ = [
    "ATTN_CONFIGS",
    "BLOCK_MAX_CONFIGS",
    "EST_CONFIGS",
    "UPCAST",
    "BlockSparseAttnFn",
    "BlockTable",
    "Int4Codes",
    "Tile",
    "attn_tiles",
    "block_max_int4_ref",
    "block_max_int4_triton",
    "block_max_ref",
    "block_max_triton",
    "block_probs_ref",
    "block_probs_triton",
    "block_sparse_attention_ref",
    "block_sparse_attention_triton",
    "block_sparse_backward_triton",
    "block_sparse_forward_triton",
    "est_tiles",
    "estimate_block_mass_ref",
    "estimate_block_mass_triton",
    "int4_codes",
    "pool_blocks_ref",
    "pool_blocks_triton",
    "table_block_size",
    "table_token_mask",
]
