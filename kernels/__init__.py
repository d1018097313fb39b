"""Triton kernels of sb_titan (shipped as `sb_titan_kernels`): block-sparse attention
forward/backward over a compressed block table, and the block-mass estimator.

One kernel family per file, its naive PyTorch reference beside it (`*_naive.py`):
attn_fwd, attn_bwd_dq, attn_bwd_dkdv (+ block_sparse_attn: launch and autograd),
estimator, block_max. Nothing here imports sb_titan (imports run model -> attention ->
kernels). `sb_titan_kernels.aot` (ahead-of-time compilation and resource checks) is
tooling and is not imported here.
"""

from .attn_bwd_dkdv_naive import attention_dkdv_ref
from .attn_bwd_dq_naive import attention_dq_ref
from .attn_common import BlockTable, table_block_size
from .attn_fwd_naive import block_sparse_attention_ref, table_token_mask
from .attn_tiles import ATTN_CONFIGS, attn_tiles
from .block_max import BLOCK_MAX_CONFIGS, block_max_int4_triton, block_max_triton
from .block_max_naive import Int4Codes, block_max_int4_ref, block_max_ref, int4_codes
from .block_sparse_attn import (
    BlockSparseAttnFn,
    block_sparse_attention_triton,
    block_sparse_backward_triton,
    block_sparse_forward_triton,
)
from .common import UPCAST, Tile
from .estimator import (
    EST_CONFIGS,
    block_probs_triton,
    est_tiles,
    estimate_block_mass_triton,
    pool_blocks_triton,
)
from .estimator_naive import block_probs_ref, estimate_block_mass_ref, pool_blocks_ref

__all__ = [
    "ATTN_CONFIGS",
    "BLOCK_MAX_CONFIGS",
    "EST_CONFIGS",
    "UPCAST",
    "BlockSparseAttnFn",
    "BlockTable",
    "Int4Codes",
    "Tile",
    "attention_dkdv_ref",
    "attention_dq_ref",
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
