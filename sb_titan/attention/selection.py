"""Block selection under a budget: estimated mass -> compressed block table + stats.

Per (row b, kv head h, query block i) the allowed key blocks are [sink(i), i]. Both
policies rank them the same way: the forced blocks (sink and diagonal) first, then by
descending estimated mass, ties to the lower block id. `topk` keeps a prefix of length
max(ceil(beta * n_allowed), n_forced); `mass` keeps the shortest prefix (at least the
forced blocks) whose mass reaches beta. beta is per query block ([B, NB]: each takes
its document's, attention/layout.block_budgets), so documents of one row can hold
different budgets; a row-wide beta is the case of equal entries. Query blocks are
processed `chunk_blocks` at a time, so the budget can change every micro-batch without
recompilation and peak extra memory stays O(chunk * NB).

The table (`BlockTable`) is the contract with the kernels: two CSR matrices over the
kept block pairs, so every table is linear in the pairs it keeps (4 bytes per pair and
side, plus 8 bytes per block of offsets). A padded layout is not: every query block
keeps its document's first (sink) block, so the transposed side would be NB wide, and
one long document among short ones widens every row of the forward side.
  kv_ptr [B, Hkv, NB + 1] int64: offsets into kv_index, global over the flat array,
  kv_index [nnz] int32: per (b, h, query block i), its kept key blocks, ascending,
  q_ptr [B, Hkv, NB + 1] int64, q_index [nnz] int32: the transpose (per key block j,
    the query blocks that kept it, ascending),
  block_size: python int (also NB = ceil(L / block_size)).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

from sb_titan.attention.backends import check_estimator
from sb_titan.attention.block_scores import check_scorer, score_chunks
from sb_titan.attention.estimator import attending, block_mass_chunks, num_blocks, sink_blocks

Policy = Literal["mass", "topk"]  # a Literal, so the CLI help lists the choices
POLICIES: tuple[str, ...] = get_args(Policy)
BLOCK_SIZES = (64, 128)
MASS_TOL = 1e-6  # `mass` stops once kept mass >= beta - MASS_TOL (fp32 cumsum slack)
TOPK_SLACK = 1e-6  # ceil(beta * n * (1 - slack)): beta=0.1 stored in fp32 keeps 1 of 10


class BlockTable(NamedTuple):
    kv_ptr: torch.Tensor  # [B, Hkv, NB + 1] int64: CSR offsets of each query block's row
    kv_index: torch.Tensor  # [nnz] int32: kept key block ids, ascending per row
    q_ptr: torch.Tensor  # [B, Hkv, NB + 1] int64: CSR offsets of each key block's column
    q_index: torch.Tensor  # [nnz] int32: query blocks that kept it, ascending
    block_size: int

    @property
    def kv_count(self) -> torch.Tensor:
        """[B, Hkv, NB] int32: key blocks kept per query block."""
        return self.kv_ptr.diff(dim=-1).to(torch.int32)

    @property
    def q_count(self) -> torch.Tensor:
        """[B, Hkv, NB] int32: query blocks that kept each key block."""
        return self.q_ptr.diff(dim=-1).to(torch.int32)

    def padded_kv(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_count, kv_index [B, Hkv, NB, width] int32 0-padded): the row-padded form
        (FlexAttention's BlockMask, the PyTorch path's chunk plan). `width` defaults to
        the longest row (a host sync); pass NB to stay traceable."""
        return self.kv_count, csr_to_padded(self.kv_ptr, self.kv_index, width)

    def padded_q(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_count, q_index [B, Hkv, NB, MAXQ] int32 0-padded): the transposed side."""
        return self.q_count, csr_to_padded(self.q_ptr, self.q_index)


def csr_to_padded(ptr: torch.Tensor, index: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[..., NB + 1] offsets + flat ids -> [..., NB, width] int32, 0-padded (width:
    default the largest count). Every real table has a pair per block, so index is
    never empty."""
    count = ptr.diff(dim=-1)
    if width is None:
        width = int(count.max()) if count.numel() else 0
    slot = torch.arange(width, device=ptr.device)
    live = slot < count[..., None]
    pos = torch.where(live, ptr[..., :-1, None] + slot, 0)
    return torch.where(live, index[pos], 0).to(torch.int32)


def padded_to_csr(count: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., NB] counts + [..., NB, W] padded ids -> (ptr [..., NB + 1] int64, flat int32)."""
    live = torch.arange(index.shape[-1], device=index.device) < count[..., None]
    return counts_to_ptr(count), index[live].to(torch.int32)


def counts_to_ptr(count: torch.Tensor) -> torch.Tensor:
    """[..., NB] counts -> [..., NB + 1] int64 offsets, global over the flat array."""
    ends = torch.cumsum(count.flatten().long(), 0).view(count.shape)
    return torch.cat([(ends - count)[..., :1], ends], dim=-1)


STATS_FIELDS = (
    "density_sum",  # kept / allowed block pairs, summed over rows
    "rows",
    "recall_sum",  # estimated recall, token-weighted sum
    "tokens",  # attending query tokens
    "true_recall_sum",  # exact kept mass over sampled (query, head) pairs, summed
    "top_hit_sum",  # sampled pairs whose key of greatest true probability was kept
    "samples",  # sampled (query, head) pairs
)
"""The statistics tensor's layout, the one place that defines it: the sparse layers add
into it, the trainer exchanges it, CP ranks scale their share of `rows` (cp_share)."""
STATS_SIZE = len(STATS_FIELDS)
BLOCK_FIELDS = (
    "true_recall_sum",  # as in STATS_FIELDS, per query block
    "top_hit_sum",
    "samples",
    "kept_blocks",  # key blocks kept, summed over kv heads
    "allowed_blocks",  # key blocks it may see (causal, its own document), times kv heads
)
"""The per-query-block statistics' layout (AttnStats.block_sums, AttnMeta.block_stats):
what the trainer credits to each block's document."""


class AttnStats(NamedTuple):
    density: torch.Tensor  # [B] float32: kept block pairs / allowed block pairs
    recall: torch.Tensor  # [B] float32: kept est. mass, mean over attending query tokens
    tokens: torch.Tensor  # [B] float32: attending query tokens (what recall averages over)
    # [B, NB] per query block once measured ([B] zeros before): summed exact kept mass of
    # sampled (query, head) pairs, those whose key of greatest true probability was kept,
    # and the pairs (0: not measured)
    true_recall: torch.Tensor
    top_hit: torch.Tensor
    samples: torch.Tensor
    blocks: torch.Tensor  # [2, B, NB] with them (block_pairs; [B] zeros before)

    @classmethod
    def estimated(cls, density, recall, tokens) -> AttnStats:
        """Selection's statistics, before any true recall is measured (zero samples)."""
        zero = torch.zeros_like(density)
        return cls(density, recall, tokens, zero, zero, zero, zero)

    def totals(self) -> torch.Tensor:
        """[STATS_SIZE] sums in STATS_FIELDS order that add up over rows, layers and
        micro-batches (their ratios are the means)."""
        rows = self.density.new_tensor(self.density.numel())
        est = [self.density.sum(), rows, (self.recall * self.tokens).sum(), self.tokens.sum()]
        return torch.stack(est + [self.true_recall.sum(), self.top_hit.sum(), self.samples.sum()])

    def block_sums(self) -> torch.Tensor:
        """[len(BLOCK_FIELDS), B, NB] float32 per query block, in BLOCK_FIELDS order:
        sums that add up over layers and CP shards (row coordinates)."""
        sampled = torch.stack([self.true_recall, self.top_hit, self.samples])
        return torch.cat([sampled.float(), self.blocks.float()])


def block_pairs(
    table: BlockTable, doc_id: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """[2, B, NB] float32: each query block's kept and allowed key blocks, summed over
    kv heads (a document's density is their ratio over its blocks); `rows` [B, NB]: a
    CP shard's own query blocks, the others count 0."""
    kept = table.kv_ptr.diff(dim=-1).sum(1)  # [B, NB]
    nb = kept.shape[-1]
    sink = sink_blocks(doc_id, table.block_size)
    allowed = (torch.arange(nb, device=kept.device) - sink + 1) * table.kv_ptr.shape[1]
    out = torch.stack([kept, allowed]).float()
    return out if rows is None else out * rows


def cp_share(totals: torch.Tensor, degree: int) -> torch.Tensor:
    """A CP shard's totals: every shard of a row counts 1 / degree of the row; its
    other sums are already its own part of the row's."""
    return torch.cat([totals[:1], totals[1:2] / degree, totals[2:]])


def attending_tokens(doc_id: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, NB] float32: tokens per query block that belong to a document of >= 2 tokens.

    Recall averages over these only. Padding (every pad token is its own document) and
    one-token documents attend to nothing but themselves: counting them would make a
    padded row look more accurate than a full one at the same budget.
    """
    B, L = doc_id.shape
    real = attending(doc_id).float()
    nb = num_blocks(L, block_size)
    real = torch.nn.functional.pad(real, (0, nb * block_size - L))
    return real.view(B, nb, block_size).sum(-1)


def transpose_table(
    kv_ptr: torch.Tensor, kv_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_ptr, q_index) of a (kv_ptr, kv_index) CSR table, by one sort of its entries.

    Memory and work are O(kept pairs); nothing of size NB^2 is allocated.
    """
    B, H, nb1 = kv_ptr.shape
    nb = nb1 - 1
    count = kv_ptr.diff(dim=-1).flatten()
    row = torch.repeat_interleave(
        torch.arange(count.numel(), device=kv_ptr.device), count, output_size=kv_index.numel()
    )  # flat (b, h, i) of each kept pair
    i = row % nb
    key_block = row - i + kv_index.long()  # flat (b, h, j)
    order = torch.argsort(key_block * nb + i, stable=True)  # by (b, h, j), then i
    q_count = torch.bincount(key_block, minlength=B * H * nb).view(B, H, nb)
    return counts_to_ptr(q_count), i[order].to(torch.int32)


def full_block_table(doc_id: torch.Tensor, num_kv_heads: int, block_size: int) -> BlockTable:
    """The density-1 table: query block i keeps every allowed key block [sink(i), i].

    With it the block-sparse kernels compute dense document-causal attention without a
    token x token mask. Built from the per-block sink alone: key block j is kept by the
    contiguous query blocks [j, last(j)], last(j) = the last i with sink(i) <= j (sink
    is non-decreasing). Both sides are ranges, written straight into CSR form: memory
    is the kept pairs, with no NB x NB mask on the way.
    """
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if doc_id.dim() != 2:
        raise ValueError(f"doc_id must be [B, L], got {tuple(doc_id.shape)}")
    B, L = doc_id.shape
    nb = num_blocks(L, block_size)
    sink = sink_blocks(doc_id, block_size)  # [B, NB] int64, non-decreasing
    blocks = torch.arange(nb, device=doc_id.device).expand(B, nb)
    last = torch.searchsorted(sink, blocks.contiguous(), right=True) - 1

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x[:, None].expand(B, num_kv_heads, nb)

    kv_ptr, kv_index = _csr_ranges(heads(sink), heads(blocks - sink + 1))
    q_ptr, q_index = _csr_ranges(heads(blocks), heads(last - blocks + 1))
    return BlockTable(kv_ptr, kv_index, q_ptr, q_index, block_size)


def _csr_ranges(first: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of rows first, first+1, ... (count entries each): (ptr int64, flat int32)."""
    ptr = counts_to_ptr(count)
    total = int(ptr[..., -1].max()) if ptr.numel() else 0
    row_first = (first.flatten() - ptr[..., :-1].flatten()).long()
    per_entry = torch.repeat_interleave(row_first, count.flatten(), output_size=total)
    return ptr, (per_entry + torch.arange(total, device=first.device)).to(torch.int32)


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    budget: torch.Tensor | float,
    policy: str,
    block_size: int,
) -> torch.Tensor:
    """Check arguments; return the budget as a float32 [B, NB] tensor on q's device."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, L, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    B, Hq, L, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (L, D):
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, L or D")
    if Hq % k.shape[1]:
        raise ValueError(f"q heads ({Hq}) must be a multiple of kv heads ({k.shape[1]})")
    if doc_id.shape != (B, L):
        raise ValueError(f"doc_id must be [B, L] = {(B, L)}, got {tuple(doc_id.shape)}")
    if L > 1 and bool((doc_id[:, 1:] < doc_id[:, :-1]).any()):
        raise ValueError("doc_id must be non-decreasing along each row (contiguous documents)")
    nb = num_blocks(L, block_size)
    budget = torch.as_tensor(budget, dtype=torch.float32, device=q.device)
    if budget.dim() == 0:
        budget = budget.expand(B)
    if budget.shape == (B,):  # a row-wide beta: every query block of the row takes it
        budget = budget[:, None].expand(B, nb)
    if budget.shape != (B, nb):
        raise ValueError(
            f"budget must be a scalar or [B] = [{B}] (row-wide), or per query block "
            f"[B, NB] = [{B}, {nb}], got {tuple(budget.shape)}"
        )
    if not bool(((budget > 0) & (budget <= 1)).all()):
        raise ValueError(f"budget must lie in (0, 1], got {budget.tolist()}")
    return budget


def _select_chunk(
    prob: torch.Tensor,
    allowed: torch.Tensor,
    sink: torch.Tensor,
    start: int,
    budget: torch.Tensor,
    policy: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept blocks of one chunk of query blocks.

    prob/allowed: [B, Hkv, n, NB]. Returns (count [B, Hkv, n], ids [B, Hkv, n, maxc]
    ascending and 0-padded, kept mass [B, Hkv, n]).
    """
    B, H, n, nb = prob.shape
    dev = prob.device
    i = torch.arange(start, start + n, device=dev)
    j = torch.arange(nb, device=dev)
    sink_i = sink[:, start : start + n]  # [B, n]
    forced = (j == i[:, None]) | (j == sink_i[:, :, None])  # [B, n, NB]
    # NaN scores (a forward on uninitialized inputs: torch's pipeline shape inference)
    # rank as no mass, never ahead of the forced blocks: the table stays valid
    key = torch.where(forced[:, None], 2.0, torch.where(allowed, prob.nan_to_num(0.0), -1.0))
    order = torch.argsort(key, dim=-1, descending=True, stable=True)
    sorted_prob = torch.gather(prob, -1, order)
    n_allowed = (i - sink_i + 1)[:, None]  # [B, 1, n]
    n_forced = 1 + (sink_i != i).long()[:, None]
    beta = budget[:, None, start : start + n]  # [B, 1, n]: each query block its own
    rank = torch.arange(nb, device=dev)
    if policy == "topk":
        want = torch.ceil(beta.double() * n_allowed * (1.0 - TOPK_SLACK)).long()
        count = torch.maximum(want, n_forced).expand(B, H, n)
    else:  # keep adding while the mass kept before this block is short of beta
        before = torch.cumsum(sorted_prob, dim=-1) - sorted_prob
        extra = (before < beta[..., None] - MASS_TOL) & (rank < n_allowed[..., None])
        count = torch.maximum(extra.sum(-1), n_forced)
    kept_mass = (sorted_prob * (rank < count[..., None])).sum(-1)
    maxc = int(count.max())
    ids = order[..., :maxc]
    ids = torch.where(torch.arange(maxc, device=dev) < count[..., None], ids, nb)
    ids = torch.sort(ids, dim=-1).values
    ids = torch.where(ids == nb, 0, ids)
    return count, ids, kept_mass


@torch.no_grad()
def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    budget: torch.Tensor | float,
    *,
    policy: str,
    block_size: int,
    scale: float | None = None,
    chunk_blocks: int = 256,
    estimator: str = "torch",
    rows: torch.Tensor | None = None,
    scorer: str = "mean",
) -> tuple[BlockTable, AttnStats]:
    """Estimate block mass and keep blocks per (row, kv head, query block) under budget.

    q: [B, Hq, L, D]; k: [B, Hkv, L, D]; doc_id: [B, L] non-decreasing per row;
    budget: [B, NB] in (0, 1], each query block's own (layout.block_budgets); a scalar
    or [B] is a row-wide beta, the same as that value in every block. Not differentiated
    (runs under no_grad).
    estimator: "torch" (PyTorch) or "triton" (the kernels: CUDA, or TRITON_INTERPRET=1);
    same masses up to fp32 rounding, so tables differ only at near-ties (docs/kernels.md).
    rows: [B, NB] bool, the query blocks this caller attends (a context-parallel shard);
    the others keep only their diagonal block and stay out of the statistics, whose
    density and token-weighted recall then add up over the shards of a row.
    scorer: the estimator family (attention/block_scores.py); `estimator` picks the
    implementation of `mean` and `int4_max` (the others run in PyTorch).
    """
    budget = _validate(q, k, doc_id, budget, policy, block_size)
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    check_estimator(estimator, q.device.type)
    check_scorer(scorer)
    B, Hkv, L, D = k.shape
    nb = num_blocks(L, block_size)
    scale = D**-0.5 if scale is None else scale
    sink = sink_blocks(doc_id, block_size)
    counts, ids, masses = [], [], []
    if scorer == "mean":
        chunks = block_mass_chunks(
            q, k, doc_id, sink, block_size=block_size, scale=scale,
            chunk_blocks=chunk_blocks, estimator=estimator,
        )  # fmt: skip
    else:
        chunk = score_chunks(
            q, k, doc_id, sink, scorer=scorer, block_size=block_size, scale=scale,
            estimator=estimator,
        )  # fmt: skip
        starts = range(0, nb, chunk_blocks)
        chunks = ((s, *chunk(s, min(s + chunk_blocks, nb))) for s in starts)
    for start, prob, allowed in chunks:
        c, idx, m = _select_chunk(prob, allowed, sink, start, budget, policy)
        counts.append(c)
        ids.append(idx)
        masses.append(m)
    kv_count = torch.cat(counts, dim=2)
    maxk = max(x.shape[-1] for x in ids)
    padded = torch.cat([torch.nn.functional.pad(x, (0, maxk - x.shape[-1])) for x in ids], 2)
    kept_mass = torch.cat(masses, dim=2)
    weight = attending_tokens(doc_id, block_size)  # [B, NB]
    if rows is not None:
        kv_count, padded = _diagonal_elsewhere(kv_count, padded, rows)
        kept_mass = kept_mass * rows[:, None]
        weight = weight * rows
    kv_ptr, kv_index = padded_to_csr(kv_count, padded)
    del padded
    q_ptr, q_index = transpose_table(kv_ptr, kv_index)
    n_allowed = (torch.arange(nb, device=q.device) - sink + 1).sum(-1) * Hkv  # [B]
    tokens = weight.sum(-1)
    kept = (kept_mass.mean(1) * weight).sum(-1)  # [B]
    counted = kv_count if rows is None else kv_count * rows[:, None]
    stats = AttnStats.estimated(
        density=(counted.sum(dim=(1, 2)) / n_allowed).float(),
        recall=torch.where(tokens > 0, kept / tokens.clamp(min=1), 1.0).float(),
        tokens=tokens,
    )
    return BlockTable(kv_ptr, kv_index, q_ptr, q_index, block_size), stats


def _diagonal_elsewhere(
    count: torch.Tensor, padded: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """count [B, H, NB], padded ids [B, H, NB, W]: query blocks outside `rows` [B, NB]
    keep their diagonal block only (the kernels need one pair per block; with a zero
    query and no output gradient it adds nothing to dK / dV)."""
    own = rows[:, None, :]
    diag = torch.arange(count.shape[-1], device=count.device).expand_as(count)
    padded = torch.where(own[..., None], padded, 0)
    padded[..., 0] = torch.where(own, padded[..., 0], diag)
    return torch.where(own, count, 1), padded


def restrict_rows(table: BlockTable, rows: torch.Tensor) -> BlockTable:
    """`table` with the query blocks outside `rows` [B, NB] cut to their diagonal."""
    count, padded = _diagonal_elsewhere(*table.padded_kv(), rows)
    kv_ptr, kv_index = padded_to_csr(count, padded)
    return BlockTable(kv_ptr, kv_index, *transpose_table(kv_ptr, kv_index), table.block_size)
