"""Which query blocks of a row each CP rank owns.

A CP rank holds the same number of blocks of every row (the linear layers' work is per
token, so equal token counts keep it balanced; and K/V all-gathers need equal shards).
What differs is attention: a query block's work is its kept key blocks. Two splits:

* `zigzag_split`: the dense head-tail split (2N contiguous chunks, rank r takes chunks
  r and 2N-1-r). It evens out one causal triangle, not packed documents or sparsity.
* `document_split` (the sparse-aware one): every rank gets an equal predicted share of
  every document. Per-block costs come from `predicted_block_pairs`, before attention
  runs; what no prediction made from lengths knows is a document's own density (how
  many far blocks its content makes attention keep), and a split that gives each rank
  ~1/N of every document is balanced whatever that density turns out to be. Packing
  blocks by predicted cost alone (LPT) balanced the prediction perfectly and the real
  tables to only 1.05-1.15 on a selective pattern (docs/context_parallel.md).

Under causal attention a query block cannot see how long its document will get, so its
kept count depends only on how many key blocks it may see (n = i - sink(i) + 1). A
density model fitted per document length, rho(L), then prices the block as the growth
of a document's kept pairs K(n) = rho(n * Bs) * n(n+1)/2 from n-1 to n blocks: the
per-block profile that sums to the document's predicted total, dense or sparse alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from sb_titan.attention.estimator import num_blocks, sink_blocks

DensityFn = Callable[[np.ndarray], np.ndarray]
"""Predicted density of documents of the given lengths (tokens) at one budget."""
DensityAt = Callable[[float], DensityFn]
"""A budget -> the DensityFn at that budget."""


class CPSplit(NamedTuple):
    """blocks[b, r] holds the global query-block ids CP rank r owns in row b, ascending;
    every rank owns NB / N blocks of every row."""

    blocks: torch.Tensor  # [B, N, NB / N] int64
    block_size: int

    @property
    def degree(self) -> int:
        return self.blocks.shape[1]

    def local(self, rank: int) -> torch.Tensor:
        """[B, NB / N] global block ids of `rank`'s shard."""
        return self.blocks[:, rank]

    def token_index(self, rank: int) -> torch.Tensor:
        """[B, NB / N * Bs] positions in the full row of `rank`'s tokens, in shard order."""
        bs = self.block_size
        blocks = self.blocks[:, rank]
        return (blocks[..., None] * bs + torch.arange(bs, device=blocks.device)).flatten(1)

    def gather_order(self) -> torch.Tensor:
        """[B, L] for each token of the full row, its index in the rank-major
        concatenation of all shards (what an all-gather returns)."""
        bs = self.block_size
        B, n, per = self.blocks.shape
        order = torch.empty(B, n * per, dtype=torch.int64, device=self.blocks.device)
        order.scatter_(1, self.blocks.flatten(1), torch.arange(n * per).expand(B, -1).clone())
        return (order[..., None] * bs + torch.arange(bs, device=order.device)).flatten(1)


def check_divisible(seq_len: int, degree: int, block_size: int) -> None:
    """A row must cut into whole blocks, the same number per rank (and 2 chunks per
    rank for zigzag)."""
    if seq_len % (2 * degree * block_size):
        raise ValueError(
            f"training.seq_len ({seq_len}) must be a multiple of "
            f"2 x context_parallel_degree x block_size = {2 * degree * block_size}"
        )


def zigzag_split(batch: int, seq_len: int, degree: int, block_size: int) -> CPSplit:
    """The dense head-tail split: 2N equal chunks, rank r owns chunks r and 2N-1-r."""
    check_divisible(seq_len, degree, block_size)
    chunk = num_blocks(seq_len, block_size) // (2 * degree)
    ranks = [
        torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                   torch.arange((2 * degree - 1 - r) * chunk, (2 * degree - r) * chunk)])
        for r in range(degree)
    ]  # fmt: skip
    blocks = torch.stack(ranks).expand(batch, -1, -1).contiguous()
    return CPSplit(blocks, block_size)


def document_split(
    cost: np.ndarray, documents: np.ndarray, degree: int, block_size: int
) -> CPSplit:
    """cost, documents [B, NB] (each block's document) -> every rank takes an equal
    predicted share of every document: per document, blocks by falling cost are dealt
    out serpentine (0..N-1, N-1..0, ...), the deal running on across documents. What a
    document's blocks really cost may be any multiple of the prediction (its own
    density, which no length model knows); each rank still gets ~1/N of it. Swaps
    within a document then even out what the deal's rounding left."""
    cost = np.asarray(cost, dtype=np.float64)
    B, nb = cost.shape
    if nb % degree:
        raise ValueError(f"{nb} blocks do not split evenly over {degree} CP ranks")
    lap, seat = np.divmod(np.arange(nb), degree)
    rank = np.where(lap % 2 == 0, seat, degree - 1 - seat)
    blocks = np.empty((B, degree, nb // degree), dtype=np.int64)
    for b in range(B):
        owner = np.empty(nb, dtype=np.int64)
        owner[np.lexsort((-cost[b], documents[b]))] = rank
        _even_out(cost[b], documents[b], owner, degree)
        for r in range(degree):
            blocks[b, r] = np.flatnonzero(owner == r)
    return CPSplit(torch.from_numpy(blocks), block_size)


def _even_out(
    cost: np.ndarray, documents: np.ndarray, owner: np.ndarray, degree: int, rounds: int = 64
) -> None:
    """Swap a block of the most-loaded rank with one *of the same document* on the
    least-loaded rank, the pair whose difference is nearest half their gap, while that
    lowers the larger: the deal's rounding, evened out without moving work between
    documents (which is what keeps the split robust to their unknown densities)."""
    for _ in range(rounds):
        load = np.bincount(owner, weights=cost, minlength=degree)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        best = (load[hi] * (1 - 1e-12), -1, -1)
        for d in np.intersect1d(documents[owner == hi], documents[owner == lo]):
            a = np.flatnonzero((owner == hi) & (documents == d))
            c = np.flatnonzero((owner == lo) & (documents == d))
            c = c[np.argsort(cost[c], kind="stable")]
            at = np.clip(np.searchsorted(cost[c], cost[a] - gap / 2), 1, len(c)) - 1
            for j in (at, np.minimum(at + 1, len(c) - 1)):
                diff = cost[a] - cost[c[j]]
                new_max = np.where(diff > 0, np.maximum(load[hi] - diff, load[lo] + diff), np.inf)
                k = int(np.argmin(new_max))
                if new_max[k] < best[0]:
                    best = (new_max[k], a[k], c[j[k]])
        if best[1] < 0:
            return
        owner[best[1]], owner[best[2]] = lo, hi


def allowed_blocks(doc_id: torch.Tensor, block_size: int) -> np.ndarray:
    """[B, NB] key blocks each query block may see: i - sink(i) + 1 (selection's rule)."""
    sink = sink_blocks(doc_id, block_size)
    i = torch.arange(sink.shape[1], device=sink.device)
    return (i - sink + 1).cpu().numpy()


def predicted_block_pairs(allowed: np.ndarray, density: DensityFn, block_size: int) -> np.ndarray:
    """[B, NB] predicted kept key blocks per query block: K(n) - K(n - 1) with
    K(n) = density(n * Bs) * n(n+1)/2, n = the blocks it may see."""
    n = np.asarray(allowed, dtype=np.float64)

    def kept(m: np.ndarray) -> np.ndarray:
        out = np.zeros_like(m)
        live = m > 0
        out[live] = density(m[live] * block_size) * m[live] * (m[live] + 1) / 2
        return out

    return np.maximum(kept(n) - kept(n - 1), 1.0)  # the diagonal is always computed


def block_pairs_at(
    allowed: np.ndarray, budget: np.ndarray, density_at: DensityAt, block_size: int
) -> np.ndarray:
    """[B, NB] `predicted_block_pairs` of each query block at its own budget [B, NB]
    (the beta selection gives it): priced once per distinct budget, over the blocks that
    hold it. A block's price depends only on its own allowed count, so a row-wide budget
    gives exactly the one-budget prices."""
    allowed = np.asarray(allowed, dtype=np.float64)
    budget = np.asarray(budget, dtype=np.float64)
    if budget.shape != allowed.shape:
        raise ValueError(f"budget {budget.shape} must be per query block {allowed.shape}")
    out = np.empty_like(allowed)
    for beta in np.unique(budget):
        at = budget == beta
        out[at] = predicted_block_pairs(allowed[at], density_at(float(beta)), block_size)
    return out


def layer_block_costs(
    allowed: np.ndarray,
    budget: np.ndarray,
    density_at: DensityAt | None,
    block_size: int,
    sparse_layers: int,
    dense_layers: int,
) -> np.ndarray:
    """[B, NB] predicted kept pairs per query block over the model's layers: dense
    layers keep every allowed block, sparse ones `predicted_block_pairs` at the block's
    budget ([B, NB])."""
    cost = dense_layers * np.asarray(allowed, dtype=np.float64)
    if sparse_layers:
        if density_at is None:
            raise ValueError("sparse layers need a density prediction to price their blocks")
        pairs = block_pairs_at(allowed, budget, density_at, block_size)
        cost = cost + sparse_layers * pairs
    return cost


def imbalance(per_rank: np.ndarray) -> float:
    """max / mean of per-rank work (1.0 = perfect balance)."""
    per_rank = np.asarray(per_rank, dtype=np.float64)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def rank_loads(cost: np.ndarray, split: CPSplit) -> np.ndarray:
    """[B, N] summed cost of each rank's blocks, per row."""
    blocks = split.blocks.cpu().numpy()
    return np.take_along_axis(
        np.asarray(cost, dtype=np.float64)[:, None, :].repeat(blocks.shape[1], 1), blocks, axis=2
    ).sum(-1)
