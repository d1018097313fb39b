"""Selection and block-sparse attention as torch.library custom ops.

TorchTitan compiles every transformer block with `fullgraph=True`, so whatever the
attention does must be traceable. Selection and the PyTorch path are data-dependent
Python (`.tolist()`, tables whose width is known only after selection), and the Triton
kernels are opaque launches; as custom ops with registered fakes and autograd, both
enter the graph as single nodes, eager and compiled runs execute the same code, and
nothing is padded to the row's block count: the tables are CSR whose length (the kept
pairs) leaves the selection op as an unbacked size, so they stay linear in the pairs.

Ops (namespace `sb_titan`):
  select_blocks(q, k, doc_id, budget, ...) -> 4 table tensors + density, recall, tokens
  full_block_table(doc_id, ...) -> the 4 tensors of the density-1 table (dense layers)
  block_sparse_attention(q, k, v, doc_id, table..., backend) -> out, lse
  block_sparse_attention_backward(grad_out, ..., out, lse, ...) -> dq, dk, dv
  true_recall(q, k, doc_id, lse, kv_ptr, kv_index, ...) -> true recall, top hits, samples
"""

from __future__ import annotations

import torch
from torch import Tensor

from sb_titan.attention.backends import OP_BACKENDS, kernels
from sb_titan.attention.block_sparse import block_sparse_backward, block_sparse_forward
from sb_titan.attention.estimator import num_blocks
from sb_titan.attention.recall import true_recall
from sb_titan.attention.selection import (
    AttnStats,
    BlockTable,
    full_block_table,
    restrict_rows,
    select_blocks,
)


# ------------------------------------------------------------------------------ selection
@torch.library.custom_op("sb_titan::select_blocks", mutates_args=())
def _select_blocks_op(
    q: Tensor,
    k: Tensor,
    doc_id: Tensor,
    budget: Tensor,
    policy: str,
    block_size: int,
    scale: float,
    estimator: str,
    rows: Tensor | None = None,
    scorer: str = "mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    table, stats = select_blocks(
        q,
        k,
        doc_id,
        budget,
        policy=policy,
        block_size=block_size,
        scale=scale,
        estimator=estimator,
        rows=rows,
        scorer=scorer,
    )
    return (*table[:4], *stats[:3])


@_select_blocks_op.register_fake
def _(q, k, doc_id, budget, policy, block_size, scale, estimator, rows=None, scorer="mean"):
    B, Hkv, L, _ = k.shape
    row = q.new_empty(B, dtype=torch.float32)
    return (
        *_fake_table(k, B, Hkv, num_blocks(L, block_size)),
        row,
        torch.empty_like(row),
        torch.empty_like(row),
    )


def _fake_table(like: Tensor, batch: int, kv_heads: int, nb: int) -> tuple[Tensor, ...]:
    """kv_ptr, kv_index, q_ptr, q_index: flat arrays of the kept pairs, an unbacked size
    between one (diagonal) pair per block and all causal pairs. Both sides hold the same
    pairs, but each gets its own symbol: with one shared symbol the compiled block read
    a later output of the selection op in place of another (recall came back as tokens;
    tests/test_compile.py), so the compiler is not told they are equal."""
    ctx = torch.library.get_ctx()
    most = batch * kv_heads * nb * (nb + 1) // 2
    # under dynamic shapes (a recompile for a new length marks dims dynamic) the bound
    # is symbolic, which new_dynamic_size refuses: the size is then bounded below only
    most = most if isinstance(most, int) else None
    nnz = [ctx.new_dynamic_size(min=1, max=most) for _ in range(2)]
    ptr = like.new_empty(batch, kv_heads, nb + 1, dtype=torch.int64)
    return (
        ptr,
        like.new_empty(nnz[0], dtype=torch.int32),
        torch.empty_like(ptr),
        like.new_empty(nnz[1], dtype=torch.int32),
    )


def select(
    q: Tensor,
    k: Tensor,
    doc_id: Tensor,
    budget: Tensor,
    *,
    policy: str,
    block_size: int,
    scale: float,
    estimator: str = "torch",
    rows: Tensor | None = None,
    scorer: str = "mean",
) -> tuple[BlockTable, AttnStats]:
    """`selection.select_blocks` as one graph node (not differentiated). budget: [B, NB]
    per query block, or a row-wide [B] or scalar."""
    budget = torch.as_tensor(budget, dtype=torch.float32, device=q.device)
    if budget.dim() == 0:
        budget = budget.expand(q.shape[0])
    q, k = q.detach(), k.detach()
    out = _select_blocks_op(
        q, k, doc_id, budget, policy, block_size, scale, estimator, rows, scorer
    )
    return BlockTable(*out[:4], block_size), AttnStats.estimated(*out[4:])


@torch.library.custom_op("sb_titan::full_block_table", mutates_args=())
def _full_table_op(
    doc_id: Tensor, num_kv_heads: int, block_size: int, rows: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    table = full_block_table(doc_id, num_kv_heads, block_size)
    return tuple((table if rows is None else restrict_rows(table, rows))[:4])


@_full_table_op.register_fake
def _(doc_id, num_kv_heads, block_size, rows=None):
    B, L = doc_id.shape
    return _fake_table(doc_id, B, num_kv_heads, num_blocks(L, block_size))


def full_table(
    doc_id: Tensor, num_kv_heads: int, block_size: int, rows: Tensor | None = None
) -> BlockTable:
    """`selection.full_block_table` as one graph node (`rows`: as in select_blocks)."""
    return BlockTable(*_full_table_op(doc_id, num_kv_heads, block_size, rows), block_size)


# ------------------------------------------------------------------------------ attention
@torch.library.custom_op("sb_titan::block_sparse_attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_id: Tensor,
    kv_ptr: Tensor,
    kv_index: Tensor,
    q_ptr: Tensor,
    q_index: Tensor,
    block_size: int,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    table = BlockTable(kv_ptr, kv_index, q_ptr, q_index, block_size)
    if backend == "triton":
        return kernels().block_sparse_forward_triton(q, k, v, doc_id, table, scale)
    out, lse = block_sparse_forward(q, k, v, doc_id, table, scale)
    return out.contiguous(), lse.contiguous()  # the layout the fake promises


@_attention_op.register_fake
def _(q, k, v, doc_id, kv_ptr, kv_index, q_ptr, q_index, block_size, scale, backend):
    B, Hq, L, _ = q.shape
    if backend == "triton":
        return _like_triton_output(q), q.new_empty(B, Hq, L, dtype=torch.float32)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(B, Hq, L, dtype=lse_dtype)


@torch.library.custom_op("sb_titan::block_sparse_attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    doc_id: Tensor,
    kv_ptr: Tensor,
    kv_index: Tensor,
    q_ptr: Tensor,
    q_index: Tensor,
    block_size: int,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    table = BlockTable(kv_ptr, kv_index, q_ptr, q_index, block_size)
    if backend == "triton":
        return kernels().block_sparse_backward_triton(
            grad_out, q, k, v, out, lse, doc_id, table, scale
        )
    dq, dk, dv = block_sparse_backward(grad_out, q, k, v, out, lse, doc_id, table, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, doc_id, kv_ptr, kv_index, q_ptr, q_index, *args):
    backend = args[-1]
    if backend == "triton":
        return _like_triton_output(q), _like_triton_output(k), _like_triton_output(v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _like_triton_output(t: Tensor) -> Tensor:
    """The kernels allocate outputs like their (last-dim contiguous) inputs."""
    return torch.empty_like(t if t.stride(-1) == 1 else t.contiguous())


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, doc_id, *table, block_size, scale, backend = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], doc_id, *table)
    ctx.block_size, ctx.scale, ctx.backend = block_size, scale, backend


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, doc_id, *table = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(
        grad_out, q, k, v, out, lse, doc_id, *table, ctx.block_size, ctx.scale, ctx.backend
    )
    return dq, dk, dv, *([None] * 8)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_id: Tensor,
    table: BlockTable,
    scale: float | None = None,
    backend: str = "torch",
) -> Tensor:
    """Differentiable block-sparse attention over `table`, one graph node per direction.

    q: [B, Hq, L, D]; k, v: [B, Hkv, L, D]; doc_id: [B, L]. `backend`: `torch` (the
    PyTorch path, any device) or `triton` (the kernels: CUDA, or TRITON_INTERPRET=1).
    """
    if backend not in OP_BACKENDS:
        raise ValueError(f"backend must be one of {OP_BACKENDS}, got {backend!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return attention_forward(q, k, v, doc_id, table, scale, backend)[0]


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, doc_id: Tensor, table: BlockTable, scale: float, backend: str
) -> tuple[Tensor, Tensor]:
    """(out, lse) of the forward op, for callers that do their own autograd (CP)."""
    return _attention_op(q, k, v, doc_id, *table[:4], table.block_size, scale, backend)


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    doc_id: Tensor,
    table: BlockTable,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the backward op, for callers that do their own autograd (CP)."""
    return _attention_backward_op(
        grad_out, q, k, v, out, lse, doc_id, *table[:4], table.block_size, scale, backend
    )


# ---------------------------------------------------------------------------- true recall
@torch.library.custom_op("sb_titan::true_recall", mutates_args=())
def _true_recall_op(
    q: Tensor,
    k: Tensor,
    doc_id: Tensor,
    lse: Tensor | None,
    kv_ptr: Tensor,
    kv_index: Tensor,
    block_size: int,
    scale: float,
    rate: float,
    lse_base2: bool,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    return true_recall(
        q, k, doc_id, lse, kv_ptr, kv_index, block_size=block_size, scale=scale,
        rate=rate, lse_base2=lse_base2, rows=rows,
    )  # fmt: skip


@_true_recall_op.register_fake
def _(q, k, doc_id, lse, kv_ptr, kv_index, block_size, scale, rate, lse_base2, rows=None):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    blocks = q.new_empty(q.shape[0], num_blocks(doc_id.shape[1], block_size), dtype=dtype)
    return blocks, torch.empty_like(blocks), torch.empty_like(blocks)


def measure_true_recall(
    q: Tensor,
    k: Tensor,
    doc_id: Tensor,
    lse: Tensor | None,
    table: BlockTable,
    *,
    scale: float,
    rate: float,
    lse_base2: bool,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`recall.true_recall` as one graph node: [B, NB] sums of true recall and top-key
    hits over each query block's sampled (query, head) pairs, and their count (lse None:
    the kept log-sum-exp is computed for the sampled queries too)."""
    lse = None if lse is None else lse.detach()
    return _true_recall_op(
        q.detach(), k.detach(), doc_id, lse, table.kv_ptr, table.kv_index,
        table.block_size, float(scale), float(rate), lse_base2, rows,
    )  # fmt: skip
