"""Per-micro-batch attention metadata: document layout and budget.

TorchTitan calls the inner attention with `attention_masks=` only (no positions), so
everything attention needs per micro-batch travels in one NamedTuple of tensors (a
pytree, so pipeline schedules split and forward it like any other kwarg).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class AttnMeta(NamedTuple):
    doc_id: torch.Tensor  # [B, L] int32: document index of each token within its row
    budget: torch.Tensor
    """[B, NB] float32: the attention budget beta of each query block (block_budgets: its
    first token's document's). One fixed shape whatever the documents, so compiled code
    does not recompile when a micro-batch's layout changes."""
    microbatch: torch.Tensor | None = None  # 0-d int64 on CPU: index within the step
    stats: torch.Tensor | None = None
    """[STATS_SIZE] float32 (layout: selection.STATS_FIELDS) the sparse layers add their
    AttnStats.totals() into (the trainer makes one per micro-batch and reads it after the
    step): statistics leave the transformer block as a tensor, not as a Python side effect."""
    cp_blocks: torch.Tensor | None = None
    """Context parallelism: [B, N, NB / N] int64, the query blocks each CP rank owns
    (context_parallel.split.CPSplit.blocks); doc_id then covers the full row while the
    model's tokens are this rank's shard."""
    block_stats: torch.Tensor | None = None
    """[len(selection.BLOCK_FIELDS), B, NB] float32: each query block's sampled true
    recall, top-key hits and pairs, kept and allowed key blocks (AttnStats.block_sums),
    summed over the sparse layers, when the trainer credits documents with their own
    recall and density ([dst] doc_history)."""


def doc_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document index per token: a document starts wherever the position is 0."""
    starts = (positions == 0).to(torch.int32)
    starts[:, 0] = 1  # a row always starts a (possibly continued) document
    return (torch.cumsum(starts, dim=1) - 1).to(torch.int32)


def doc_ids_from_lengths(rows: list[list[int]], seq_len: int) -> torch.Tensor:
    """[B, L] int64 document ids of packed rows from their document lengths, laid out as
    the loader lays them out: documents in order, then every padding token its own
    document (what doc_ids_from_positions gives for the loader's positions)."""
    out = torch.empty(len(rows), seq_len, dtype=torch.int64)
    for b, lens in enumerate(rows):
        ids = torch.arange(len(lens)).repeat_interleave(torch.tensor(lens, dtype=torch.int64))
        out[b] = torch.cat([ids, len(lens) + torch.arange(seq_len - len(ids))])
    return out


def block_budgets(
    doc_id: torch.Tensor,
    doc_budgets: Sequence[Sequence[float]],
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[B, NB] on doc_id's device: each query block takes the beta of the document of
    its first token, the document whose sink it attends from (float32: what selection
    reads; float64 keeps the betas exact for pricing).

    doc_budgets[b][d] is row b's document d's beta (`[[beta]] * B`: a row-wide beta).
    Documents past a row's list (padding: every pad token is its own document) take the
    row's last beta: a padding block keeps its diagonal only whatever its beta, and the
    shape stays [B, NB] however many padding documents a row has."""
    B = doc_id.shape[0]
    if len(doc_budgets) != B or any(len(row) == 0 for row in doc_budgets):
        raise ValueError(f"need a non-empty list of document budgets for each of {B} rows")
    width = max(len(row) for row in doc_budgets)
    table = torch.tensor(
        [[*row, *[row[-1]] * (width - len(row))] for row in doc_budgets], dtype=dtype
    ).to(doc_id.device)
    first = doc_id[:, ::block_size].long().clamp(max=width - 1)  # [B, NB]
    return table.gather(1, first)


def document_sums(
    block_values: torch.Tensor, doc_id: torch.Tensor, docs_per_row: Sequence[int], block_size: int
) -> torch.Tensor:
    """[D, C] float64: block_values [C, B, NB] summed per document, for the documents of
    the rows in order (row b holds docs_per_row[b] of them, then padding). A query block
    counts toward the document of its first token, whose budget it trained with
    (block_budgets); padding blocks count toward none."""
    C, B, nb = block_values.shape
    if len(docs_per_row) != B:
        raise ValueError(f"document_sums: {len(docs_per_row)} rows of documents, values have {B}")
    first = doc_id[:, ::block_size].long().cpu()  # [B, NB]
    count = torch.tensor(docs_per_row, dtype=torch.int64)
    offset = torch.cumsum(count, 0) - count  # the row's first document in the output
    real = first < count[:, None]
    out = torch.zeros(int(count.sum()), C, dtype=torch.float64)
    values = block_values.detach().cpu().double().permute(1, 2, 0)  # [B, NB, C]
    return out.index_add_(0, (offset[:, None] + first)[real], values[real])


def doc_lens_from_doc_id(doc_id: torch.Tensor) -> list[list[int]]:
    """Document lengths per row (host copy; for logging and cost prediction)."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in doc_id]


def document_causal_mask(doc_id: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool: query i may attend key j iff j <= i and same document.

    Reference only (tests, small L): it is token x token, 4 GiB per row at 64K. The
    model's dense path (`attention.dense`) never builds it."""
    L = doc_id.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_id.device).tril()
    same_doc = doc_id[:, :, None] == doc_id[:, None, :]
    return (same_doc & causal)[:, None]
