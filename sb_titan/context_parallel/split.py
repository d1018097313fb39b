"""Which query blocks of a row each CP rank owns.

A CP rank holds the same number of blocks of every row (the linear layers' work is per
token, so equal token counts keep it balanced; and K/V all-gathers need equal shards).
What differs is attention: a query block's work is its kept key blocks. Two splits:

* `zigzag_split`: the dense head-tail split (2N contiguous chunks, rank r takes chunks
  r and 2N-1-r). It evens out one causal triangle, not packed documents or sparsity.
* `balanced_split`: blocks go, heaviest first, to the least-loaded rank that still has
  room (LPT with equal cardinality), then pairwise swaps even out the rest, under a
  per-block cost predicted before attention runs (`predicted_block_pairs`).

Under causal attention a query block cannot see how long its document will get, so its
kept count depends only on how many key blocks it may see (n = i - sink(i) + 1). A
density model fitted per document length, rho(L), then prices the block as the growth
of a document's kept pairs K(n) = rho(n * Bs) * n(n+1)/2 from n-1 to n blocks: the
per-block profile that sums to the document's predicted total, dense or sparse alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from sb_titan.attention.estimator import num_blocks, sink_blocks

DensityFn = Callable[[np.ndarray], np.ndarray]
"""Predicted density of documents of the given lengths (tokens) at the row's budget."""


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


def balanced_split(cost: np.ndarray, degree: int, block_size: int) -> CPSplit:
    """cost [B, NB] (predicted work per query block) -> the split that gives each rank
    NB / N blocks of every row: heaviest block first to the least-loaded rank with room,
    then swaps between the most- and least-loaded ranks while they lower the maximum.
    Deterministic (stable orders, ties to the lower rank), so every rank of a CP group
    computes the same split from the same costs."""
    cost = np.asarray(cost, dtype=np.float64)
    B, nb = cost.shape
    if nb % degree:
        raise ValueError(f"{nb} blocks do not split evenly over {degree} CP ranks")
    per = nb // degree
    blocks = np.empty((B, degree, per), dtype=np.int64)
    for b in range(B):
        owner = _greedy(cost[b], degree, per)
        _swap_down(cost[b], owner, degree)
        for r in range(degree):
            blocks[b, r] = np.flatnonzero(owner == r)
    return CPSplit(torch.from_numpy(blocks), block_size)


def _greedy(cost: np.ndarray, degree: int, per: int) -> np.ndarray:
    heap = [(0.0, r) for r in range(degree)]  # (load, rank) of ranks with room
    filled = [0] * degree
    owner = np.empty(len(cost), dtype=np.int64)
    for i in np.argsort(-cost, kind="stable"):
        load, r = heapq.heappop(heap)
        owner[i] = r
        filled[r] += 1
        if filled[r] < per:
            heapq.heappush(heap, (load + float(cost[i]), r))
    return owner


def _swap_down(cost: np.ndarray, owner: np.ndarray, degree: int, rounds: int = 64) -> None:
    """Swap one block of the most-loaded rank with one of the least-loaded rank, the
    pair whose difference is closest to half their gap, while that lowers the larger."""
    for _ in range(rounds):
        load = np.bincount(owner, weights=cost, minlength=degree)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        a = np.flatnonzero(owner == hi)
        c = np.flatnonzero(owner == lo)
        c = c[np.argsort(cost[c], kind="stable")]
        # for each block of hi, the block of lo with cost nearest cost[a] - gap / 2
        want = cost[a] - gap / 2
        at = np.clip(np.searchsorted(cost[c], want), 1, len(c)) - 1
        best = None
        for j in (at, np.minimum(at + 1, len(c) - 1)):
            d = cost[a] - cost[c[j]]
            new_max = np.maximum(load[hi] - d, load[lo] + d)
            k = int(np.argmin(new_max))
            if d[k] > 0 and new_max[k] < load[hi] - 1e-12 * load[hi]:
                if best is None or new_max[k] < best[0]:
                    best = (new_max[k], a[k], c[j[k]])
        if best is None:
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


def layer_block_costs(
    allowed: np.ndarray,
    density: DensityFn | None,
    block_size: int,
    sparse_layers: int,
    dense_layers: int,
) -> np.ndarray:
    """[B, NB] predicted kept pairs per query block over the model's layers: dense
    layers keep every allowed block, sparse ones `predicted_block_pairs`."""
    cost = dense_layers * np.asarray(allowed, dtype=np.float64)
    if sparse_layers:
        if density is None:
            raise ValueError("sparse layers need a density prediction to price their blocks")
        cost = cost + sparse_layers * predicted_block_pairs(allowed, density, block_size)
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
