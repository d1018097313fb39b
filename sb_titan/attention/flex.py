"""FlexAttention on sb_titan's block table: the `flex` backend and the one BlockMask
builder that the dense path and the benchmarks share.

Why a second GPU backend: FlexAttention is PyTorch's maintained block-sparse attention
(TorchTitan's `FlexAttention` module; on Hopper/Blackwell it can lower to a FlashAttention-4
kernel). Fed the SAME selection table as our Triton kernels it is a like-for-like
comparison of the attention kernels alone (docs/attention.md, "The flex backend").

The table (per row b, kv head h, query block i: the kept key blocks, ascending) already
has a BlockMask's shape. What Flex adds:
  * full vs partial blocks: a kept pair (i, j < i) whose tokens all lie in one document
    is "full" (Flex skips mask_mod there); the diagonal and pairs that cross a document
    start are "partial" and get the document-causal mask_mod (key <= query, same doc).
  * heads: Flex indexes the mask with `q_head % H_mask` on GPU (its Triton template) and
    `q_head // (Hq / H_mask)` on CPU, so only H_mask in {1, Hq} means the same on both:
    a per-kv-head table is repeated over its Hq/Hkv query heads (one head stays 1).
  * size: kv_indices is NB wide (Flex's transpose reads the number of key blocks from
    it) and q_indices is its transpose, so the mask is block-QUADRATIC:
    4 int32 [B, Hq, NB, NB] tensors (partial/full x kv/q side), e.g. 224 MiB per layer
    call for Qwen2.5-0.5B at 64K (docs/attention.md has the table per shipped config).

Flex runs compiled only: eager Flex computes the whole score matrix. CPU Flex (inductor's
C++ template) has a forward and no backward, so `flex` trains on CUDA only.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import flex_attention as _flex

try:  # torch >= 2.9 asks for the log-sum-exp this way; return_lse before
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # pragma: no cover - older torch
    _AuxRequest = None

from sb_titan.attention.estimator import token_doc_start
from sb_titan.attention.selection import BlockTable


def _kv_blocks(table: BlockTable) -> tuple[Tensor, Tensor]:
    """(kv_count [B, H, NB] int32, kv_index [B, H, NB, NB] int32): the key blocks each
    query block keeps, ascending, anything past kv_count ignored. NB wide because Flex's
    BlockMask is (and a fixed width needs no host sync, so this traces inside a
    compiled block).

    The only place this module reads the table's layout.
    """
    return table.padded_kv(width=table.kv_ptr.shape[-1] - 1)


def block_mask(table: BlockTable, doc_id: Tensor, num_q_heads: int):
    """A FlexAttention BlockMask holding exactly the block pairs of `table`.

    doc_id: [B, L] non-decreasing per row. The mask has 1 head if the table has one
    (shared by every query head), else `num_q_heads` (each kv head's pattern repeated
    over its query heads, as Flex's GPU kernel requires).
    """
    kv_count, kv_index = _kv_blocks(table)
    B, H, nb = kv_count.shape
    bs, L = table.block_size, doc_id.shape[1]
    if num_q_heads % H:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of table heads ({H})")
    width = kv_index.shape[-1]
    kept = torch.arange(width, device=kv_index.device) < kv_count[..., None]
    j = kv_index.long()
    i = torch.arange(nb, device=j.device)[:, None]
    # query block i's last token starts its document at or before key block j's first
    # token, and j < i: every (query, key) token pair of the block is allowed
    last_tok = ((torch.arange(nb, device=j.device) + 1) * bs).clamp(max=L) - 1
    last_start = token_doc_start(doc_id)[:, last_tok]  # [B, NB]
    whole = (j < i) & (last_start[:, None, :, None] <= j * bs)
    full = kept & whole
    partial = kept & ~whole
    doc = doc_id

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    mask = BlockMask.from_kv_blocks(
        *_ordered(partial, kv_index, nb),
        *_ordered(full, kv_index, nb),
        BLOCK_SIZE=bs,
        mask_mod=document_causal,
        seq_lengths=(L, L),
    )
    if H == 1 or H == num_q_heads:
        return mask
    g = num_q_heads // H
    tensors = [getattr(mask, name) for name in _INDEX_ATTRS]
    return BlockMask(
        mask.seq_lengths,
        *(t.repeat_interleave(g, dim=1) for t in tensors),
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=mask.mask_mod,
    )


_INDEX_ATTRS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def block_mask_bytes(rows: int, q_heads: int, kv_heads: int, seq_len: int, block: int) -> int:
    """Bytes of the index tensors `block_mask` returns for these shapes (what the
    docs' memory table lists): per row and mask head, 4 [NB, NB] int32 index tensors
    (partial/full x kv/q side) and 4 [NB] int32 counts, whatever the density."""
    nb = -(-seq_len // block)
    heads = 1 if kv_heads == 1 else q_heads
    return rows * heads * 4 * (nb * nb + nb) * 4


def _ordered(keep: Tensor, kv_index: Tensor, nb: int) -> tuple[Tensor, Tensor]:
    """(count [.., NB] int32, ids [.., NB, NB] int32): the entries of `kv_index` where
    `keep`, still ascending, first in each row, 0-padded to NB columns (Flex's format)."""
    order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)
    count = keep.sum(-1, dtype=torch.int32)
    ids = torch.gather(kv_index, -1, order)
    ids = torch.where(torch.arange(ids.shape[-1], device=ids.device) < count[..., None], ids, 0)
    ids = torch.nn.functional.pad(ids, (0, nb - ids.shape[-1]))
    return count, ids.to(torch.int32).contiguous()


# Flex's own CUDA tiles go up to 128 x 128 (torch 2.11-2.13 on H100: forward 128 x 128
# at D 64 and 128 x 64 at D 128; backward 64 x 128 / 128 x 64), and a tile must divide
# the mask's block. At block 64 the forward takes the tile below; the backward only
# filters its configs by the block (kernel options cannot rescue a filtered one), so
# small-block Flex compiles with max_autotune, whose candidates include tiles that fit.
FLEX_TILE = 64


def flex_kernel_options(block_size: int, device_type: str) -> dict | None:
    """kernel_options for flex_attention on a mask of `block_size` blocks, or None where
    Flex's defaults fit (CPU, or blocks of 128 and more)."""
    if device_type != "cuda" or block_size % 128 == 0:
        return None
    tile = math.gcd(block_size, FLEX_TILE)
    return {"fwd_BLOCK_M": tile, "fwd_BLOCK_N": tile}


@functools.cache
def _compiled_flex(autotune: bool):
    """flex_attention compiled once per process (as TorchTitan's FlexAttention module
    does): eager Flex would materialise the [L, L] scores."""
    options = {"max_autotune": True} if autotune else None
    return torch.compile(_flex, dynamic=False, options=options)


def compiled_flex_attention(block_size: int = 128, device_type: str = "cpu"):
    """The flex_attention to call here: inside a compiled region the plain function
    (Dynamo traces it into the region's graph), else the once-compiled one (with
    max_autotune where `flex_kernel_options` says Flex's default tiles do not fit)."""
    if torch.compiler.is_compiling():
        return _flex
    return _compiled_flex(flex_kernel_options(block_size, device_type) is not None)


def flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_id: Tensor,
    table: BlockTable,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse attention over `table` by compiled FlexAttention, differentiable on
    CUDA. q: [B, Hq, L, D]; k, v: [B, Hkv, L, D]; doc_id: [B, L]. Same contract as
    ops.block_sparse_attention: query t attends key s iff s's block is kept for t's
    block, s <= t and both lie in one document. return_lse: also the natural-log
    log-sum-exp [B, Hq, L] (Flex converts its base-2 statistics)."""
    if not torch.is_grad_enabled():  # Flex refuses CPU inputs that require grad at all
        q, k, v = q.detach(), k.detach(), v.detach()
    elif q.device.type != "cuda" and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            f"backend='flex' on {q.device.type} runs forward only (FlexAttention has no "
            "CPU backward); use backend='torch' to train off CUDA"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = block_mask(table, doc_id, q.shape[1])
    gqa = q.shape[1] != k.shape[1]
    bs, device = table.block_size, q.device.type
    flex = compiled_flex_attention(bs, device)
    kwargs = dict(block_mask=mask, scale=scale, enable_gqa=gqa)
    kwargs["kernel_options"] = flex_kernel_options(bs, device)
    if not return_lse:
        return flex(q, k, v, **kwargs)
    if _AuxRequest is None:  # torch before AuxRequest: the older keyword
        return flex(q, k, v, return_lse=True, **kwargs)
    out, aux = flex(q, k, v, return_aux=_AuxRequest(lse=True), **kwargs)
    return out, aux.lse
